#!/usr/bin/env bash
# Build (once) a cached venv holding one vLLM version, for the oracle tier (docs/oracle.md).
#   tests/oracle/build_venv.sh 0.33.0   -> prints the venv path
# vLLM is installed --no-deps; its requirements are installed except the GPU kernel packages
# (flashinfer, tilelang, cutlass-dsl, ...), which start-up sizing never imports. torch is the
# exact version vLLM pins, from PyPI (the CUDA build; it imports without a GPU). A stub
# libcuda.so.1 (stub_libcuda.c) is built into the venv for the import-time driver calls.
set -euo pipefail
VER="${1:?usage: build_venv.sh VLLM_VERSION}"
ROOT="${VLLMFIT_ORACLE_CACHE:-$HOME/.cache/vllmfit-oracle}"
VENV="$ROOT/$VER"
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PY:-python3}"
if [ -f "$VENV/.complete" ]; then echo "$VENV"; exit 0; fi
mkdir -p "$ROOT/dl"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
# pip.conf constraints of this machine must not pin vLLM's dependencies
export PIP_CONSTRAINT=""
WHEEL="$(ls "$ROOT"/dl/vllm-"$VER"-*.whl 2>/dev/null | head -1 || true)"
if [ -z "$WHEEL" ]; then
  "$VENV/bin/pip" download -q --no-deps "vllm==$VER" -d "$ROOT/dl" >&2
  WHEEL="$(ls "$ROOT"/dl/vllm-"$VER"-*.whl | head -1)"
fi
"${PIP[@]}" packaging >&2
# vLLM's requirements, less the GPU kernel and media packages
"$VENV/bin/python" - "$WHEEL" > "$VENV/oracle-reqs.txt" 2> "$VENV/oracle-skipped.txt" <<'PY'
import re, sys, zipfile
from packaging.requirements import Requirement
SKIP = re.compile(r"^(flashinfer|tilelang|apache-tvm-ffi|nvidia-|quack-kernels|tokenspeed|humming|"
                  r"pynvvideocodec|torchcodec|torchaudio|fastsafetensors|instanttensor|nvtx|"
                  r"cupy|triton-kernels|deep-gemm|deep-ep|xformers|flash-attn|vllm-flash-attn|"
                  r"ray|intel|tpu|cuda-python|cuda-bindings|kernels)", re.I)
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    r = Requirement(line.split(":", 1)[1].strip())
    if r.marker and not r.marker.evaluate({"extra": ""}):
        if r.marker.evaluate({"extra": "flashinfer"}):  # 0.11: the Docker image's extra
            r.marker = None
            print(str(r), file=sys.stderr)
        continue
    name = r.name.lower().replace("_", "-")
    r.marker = None
    if SKIP.match(name):
        print(str(r), file=sys.stderr)
        continue
    r.marker = None
    print(str(r))
PY
TORCH="$(grep -E '^torch(==|>=|<|$)' "$VENV/oracle-reqs.txt" || echo torch)"
grep -vE '^torch(==|>=|<|$)' "$VENV/oracle-reqs.txt" > "$VENV/oracle-reqs-rest.txt"
"${PIP[@]}" "$TORCH" >&2
"${PIP[@]}" -r "$VENV/oracle-reqs-rest.txt" >&2 || {
  # one unavailable optional package must not stop the build: install line by line
  while read -r req; do "${PIP[@]}" "$req" >&2 || echo "oracle: skipped $req" >&2; done < "$VENV/oracle-reqs-rest.txt"
}
# FlashInfer's Python package (no kernels: none is run) so that vLLM chooses its attention
# backends as on a real install (FlashInfer is the default on Blackwell, and for an fp8 KV cache)
for req in $(grep -iE '^(flashinfer-python|apache-tvm-ffi)' "$VENV/oracle-skipped.txt" || true); do
  "${PIP[@]}" --no-deps "$req" >&2 || echo "oracle: skipped $req" >&2
done
"${PIP[@]}" --no-deps nvidia-ml-py >&2
"${PIP[@]}" --no-deps "$WHEEL" >&2
gcc -shared -fPIC -O2 -o "$VENV/libcuda.so.1" "$HERE/stub_libcuda.c"
ln -sf libcuda.so.1 "$VENV/libcuda.so"
touch "$VENV/.complete"
echo "$VENV"
