#!/bin/bash
# Stage Ray for the GPU machine (it reaches no registry), after ../shared/gpu/stage.sh has staged vLLM: two more
# folders, .gpu5 and .gpu6 (git-excluded), each carried in one `run` call right after the four of vLLM:
#   call 5: carry [".gpu5"]  command: bash .gpu5/install_ray.sh
#   call 6: carry [".gpu6"]  command: bash .gpu6/install_ray.sh && export PYTHONPATH=/tmp/site && ...
# On the GPU machine a wheel goes into /tmp/site only where python cannot already import what it holds, so the
# versions vLLM was staged with stay.
set -euo pipefail
ROOT="$(pwd)"
CACHE="${GPU_STAGE_CACHE:-/tmp/gpu-stage-cache}/ray"
mkdir -p "$CACHE/wheels"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$CACHE/wheels" ray 2>&1 | grep -v "^WARNING: Location" || true
tar -cf "$CACHE/ray.tar" -C "$CACHE" wheels
rm -rf "$CACHE/parts" && mkdir -p "$CACHE/parts"
size=$(( $(stat -c %s "$CACHE/ray.tar") / 2 + 1 ))
split -b "$size" -d -a 1 "$CACHE/ray.tar" "$CACHE/parts/ray."
for i in 5 6; do
  grep -qx "/.gpu$i/" "$ROOT/.git/info/exclude" 2>/dev/null || echo "/.gpu$i/" >> "$ROOT/.git/info/exclude"
  rm -rf "$ROOT/.gpu$i" && mkdir -p "$ROOT/.gpu$i"
  cp "$CACHE/parts/ray.$((i - 5))" "$ROOT/.gpu$i/"
  cat > "$ROOT/.gpu$i/install_ray.sh" <<'INSTALL'
#!/bin/bash
set -e
mkdir -p /tmp/ray-parts
cp .gpu*/ray.* /tmp/ray-parts/
[ -f /tmp/ray-parts/ray.0 ] && [ -f /tmp/ray-parts/ray.1 ] || { echo "have $(ls /tmp/ray-parts | wc -l) of 2 ray parts"; exit 0; }
[ -f /tmp/site/ray/__init__.py ] && { echo "ray already installed"; exit 0; }
cat /tmp/ray-parts/ray.* | tar -xf - -C /tmp/ray-parts
declare -A modules=([attrs]=attrs [certifi]=certifi [charset_normalizer]=charset_normalizer [click]=click
  [filelock]=filelock [idna]=idna [jsonschema]=jsonschema [jsonschema_specifications]=jsonschema_specifications
  [msgpack]=msgpack [packaging]=packaging [protobuf]=google.protobuf [pyyaml]=yaml [PyYAML]=yaml [ray]=ray
  [referencing]=referencing [requests]=requests [rpds_py]=rpds [typing_extensions]=typing_extensions [urllib3]=urllib3)
for wheel in /tmp/ray-parts/wheels/*.whl; do
  name=$(basename "$wheel" | cut -d- -f1)
  PYTHONPATH=/tmp/site python3 -c "import ${modules[$name]:-$name}" 2>/dev/null && continue
  echo "installing $(basename "$wheel")"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$wheel"
done
PYTHONPATH=/tmp/site python3 -c "import ray, vllm; print('ray', ray.__version__, 'vllm', vllm.__version__)"
INSTALL
done
du -sh "$ROOT"/.gpu5 "$ROOT"/.gpu6
