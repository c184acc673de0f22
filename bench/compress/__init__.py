"""`bitdelta compress`: throughput, its defaults, and delta modes at equal bytes."""
