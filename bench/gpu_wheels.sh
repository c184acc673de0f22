#!/usr/bin/env bash
# Downloads into .whl/ (repo root, git-ignored) the wheels of the project's runtime deps that the
# GPU image lacks (it has jax/jaxlib with CUDA, flax, orbax, optax, tensorstore, torch, triton,
# numpy, ml-dtypes), for CPython 3.12 on manylinux x86_64, so that `bench/gpu_check.sh` can
# install them offline with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
#
#   bash bench/gpu_wheels.sh          # then: du -sh .whl
#
# Every package is pinned, and so is each of its own dependencies (checked with
# `unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist`), because the install runs with
# --no-deps. Deliberately left out: huggingface-hub (tokenizers needs it only for
# `Tokenizer.from_pretrained`, which the project does not call), sentencepiece (optional in gguf).
# llguidance 1.9.1 is published only as cp39-abi3-manylinux_2_31_x86_64, hence that platform too
# (the GPU image's glibc must be >= 2.31; gpu_check's env stage records it; only structured
# output imports llguidance, lazily).
# PyYAML and typing-extensions are in the image already (flax needs them) but are small, so they
# travel too, in case the image's copies are missing or old.
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(
  # the project's runtime dependencies (pyproject.toml) missing from the GPU image
  safetensors==0.8.0
  tokenizers==0.23.3
  gguf==0.19.0
  jinja2==3.1.6
  aiohttp==3.14.5
  prometheus-client==0.26.0
  llguidance==1.9.1
  tqdm==4.70.1
  # the benches' HTTP client (bench/serving/) and gguf's optional downloads
  requests==2.34.2
  # their own dependencies
  markupsafe==3.0.3         # jinja2
  aiohappyeyeballs==2.7.1   # aiohttp
  aiosignal==1.4.0          # aiohttp
  attrs==26.1.0             # aiohttp
  frozenlist==1.8.0         # aiohttp, aiosignal
  multidict==7.2.1          # aiohttp, yarl
  propcache==0.5.4          # aiohttp, yarl
  yarl==1.25.1              # aiohttp
  idna==3.20                # yarl, requests
  urllib3==2.7.0            # requests
  certifi==2026.5.20        # requests
  charset-normalizer==3.4.7 # requests
  pyyaml==6.0.3             # gguf (also flax's, normally present)
  typing-extensions==4.16.0 # aiohttp, aiosignal (also flax's, normally present)
  threadpoolctl==3.8.0      # bitdelta_jax.delta.residual (lazy import)
)

mkdir -p .whl
for spec in "${PKGS[@]}"; do
  name=${spec%%==*}
  # already there? (wheel file names use the normalised name: lower case, '-' -> '_')
  norm=$(echo "$name" | tr 'A-Z-' 'a-z_')
  ver=${spec##*==}
  if compgen -G ".whl/${norm}-${ver}-*.whl" > /dev/null || compgen -G ".whl/${name}-${ver}-*.whl" > /dev/null; then
    continue
  fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$spec"
done

echo "wheels in .whl/:"
ls -1 .whl
du -sh .whl
echo "Requires-Dist of each (check that every non-optional one is in the image or in .whl/):"
for w in .whl/*.whl; do
  deps=$(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
         | sed 's/^Requires-Dist: //' | tr '\n' ';' || true)
  echo "  $(basename "$w"): ${deps:-(none)}"
done
