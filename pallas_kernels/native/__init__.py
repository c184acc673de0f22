"""Native (C++) kernel support: `build` compiles and loads kernel libraries; ``pool.h`` is the
thread pool every library shares."""
