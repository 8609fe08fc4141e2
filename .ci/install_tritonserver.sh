#!/usr/bin/env bash
# Install a CPU Triton Inference Server (2.51, r24.10, with the python backend) into .tritonserver/.
#
# The server binary, the python backend and its stubs ship inside the PyPI wheel nvidia-pytriton 0.7.0. The wheel
# is unpacked, never pip-installed (its numpy<2 and tritonclient pins clash with the project's). The python
# backend's stub runs an isolated interpreter that finds its environment through `python3` on PATH, so it gets a
# small venv of its own: numpy<2 (2.51's python backend misreads BYTES tensors under numpy 2) and a .pth that adds
# the project venv's site-packages after its own. `.tritonserver/tritonserver` wraps the binary with that PATH, the
# directory of libpython on LD_LIBRARY_PATH and --backend-directory; give it to launch_triton.sh as TRITONSERVER.
# Needs glibc >= 2.35 and x86_64. Usage: .ci/install_tritonserver.sh [PYTHON] (default .venv/bin/python).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
DEST="$ROOT/.tritonserver"
WHEEL=nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl
WHEEL_SHA256=21f063ff93bb426d0c06b7a55e7eb9efcfe62c0dddd9a908e9877e18710128df
STUB_NUMPY=numpy==1.26.4

if [[ ! -x "$PY" ]]; then
  echo "install_tritonserver.sh: $PY is not a Python interpreter; run make .venv/.installed first" >&2
  exit 2
fi
rm -rf "$DEST"
trap '[[ -f "$DEST/.installed" ]] || rm -rf "$DEST"' EXIT
mkdir -p "$DEST/download"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST/download" nvidia-pytriton==0.7.0
echo "$WHEEL_SHA256  $DEST/download/$WHEEL" | sha256sum --check --quiet
"$PY" -m zipfile -e "$DEST/download/$WHEEL" "$DEST/wheel"
rm -rf "$DEST/download"
SERVER="$DEST/wheel/pytriton/tritonserver"
PYVER="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
STUB="$SERVER/python_backend_stubs/$PYVER/triton_python_backend_stub"
if [[ ! -f "$STUB" ]]; then
  echo "install_tritonserver.sh: the wheel has no python backend stub for Python $PYVER (3.8-3.13 only)" >&2
  exit 2
fi
# Same depth as the stubs folder, so the stub's RPATH to nvidia_pytriton.libs still resolves.
cp "$STUB" "$SERVER/backends/python/triton_python_backend_stub"
chmod +x "$SERVER/bin/tritonserver" "$SERVER/backends/python/triton_python_backend_stub"

"$PY" -m venv --without-pip "$DEST/stub-env"
"$PY" -m pip install --quiet --no-deps --only-binary=:all: --target "$("$DEST/stub-env/bin/python" -c \
  'import sysconfig; print(sysconfig.get_paths()["purelib"])')" "$STUB_NUMPY"
PROJECT_SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STUB_SITE="$("$DEST/stub-env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$PROJECT_SITE')" > "$STUB_SITE/dflash_trt_project.pth"
LIBDIR="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"

cat > "$DEST/tritonserver" <<WRAPPER
#!/usr/bin/env bash
# tritonserver 2.51 (CPU) with the python backend; arguments go to the server.
HERE="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)"
export PATH="\$HERE/stub-env/bin:\$PATH"
export LD_LIBRARY_PATH="$LIBDIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "\$HERE/wheel/pytriton/tritonserver/bin/tritonserver" \\
  --backend-directory="\$HERE/wheel/pytriton/tritonserver/backends" "\$@"
WRAPPER
chmod +x "$DEST/tritonserver"
for binary in "$SERVER/bin/tritonserver" "$SERVER/backends/python/triton_python_backend_stub"; do
  if LD_LIBRARY_PATH="$LIBDIR" ldd "$binary" | grep -q "not found"; then
    echo "install_tritonserver.sh: $binary misses shared libraries (glibc >= 2.35 is needed):" >&2
    LD_LIBRARY_PATH="$LIBDIR" ldd "$binary" | grep "not found" >&2
    exit 2
  fi
done
touch "$DEST/.installed"
echo "tritonserver installed: $DEST/tritonserver"
