#!/usr/bin/env bash
# Check both ends of the declared torch range (pyproject.toml, versions.py): for each version, a
# fresh virtual environment with that torch, this project and its test extras, then the fast tests.
#   bash .ci/torch_range.sh                 # the minimum (versions.MIN_TORCH) and the newest release
#   bash .ci/torch_range.sh 2.7.1 2.9.0     # chosen versions
#   bash .ci/torch_range.sh --too-old 2.5.1 # a version below the range: main.py must refuse it in one line
# Run it whenever the range changes. Each environment downloads a whole torch (on Linux with its CUDA
# libraries: a few GB) into a temporary directory that is removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_quiet=(-q --disable-pip-version-check)

fresh_env() {  # $1: torch version -> prints the environment's directory
  local env
  env=$(mktemp -d)
  python3 -m venv "$env"
  # torch and everything else in one resolver pass (so torch's own pins hold), then the project
  # itself without dependencies (so a torch below its range still installs, for --too-old).
  "$env/bin/pip" install "${pip_quiet[@]}" "torch==$1" "hydra-core>=1.3" "fsspec>=2023.1" "boto3>=1.28" \
    "pytest>=7" "moto[server]>=5" "matplotlib>=3.5" "tensorboard>=2.10" >&2
  "$env/bin/pip" install "${pip_quiet[@]}" --no-deps -e . >&2
  echo "$env"
}

if [ "${1:-}" = "--too-old" ]; then
  env=$(fresh_env "$2")
  out=$("$env/bin/python" main.py 2>&1) && code=0 || code=$?
  rm -rf "$env"
  echo "torch $2: exit $code: $out"
  [ "$code" -ne 0 ] && [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] && [[ "$out" == *"needs torch >="* ]]
  exit
fi

min=$(python3 -c "import versions; print(versions.MIN_TORCH)")
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
  newest=$(python3 -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p')
  versions=("$min.0" "$newest")
fi
status=0
for v in "${versions[@]}"; do
  env=$(fresh_env "$v")
  echo "torch $v: $("$env/bin/python" -c 'import torch; print(torch.__version__)') installed"
  if "$env/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider; then
    echo "torch $v: the fast tests pass"
  else
    echo "torch $v: FAILED"; status=1
  fi
  rm -rf "$env"
done
exit $status
