#!/usr/bin/env bash
# The version matrix (docs/versions.md): one venv per corner, then the quick suite
# (-m "not slow"), the 2-rank Trainer parity/resume/user-script cases and, in the lf corner,
# LLaMA-Factory's flows. One corner at a time (each runs 2-rank tests on the CPU).
#
#   scripts/test_versions.sh                  # every corner
#   scripts/test_versions.sh oldest lf        # some corners
#   QUICK_ONLY=1 scripts/test_versions.sh t457
#   BUILD_ONLY=1 scripts/test_versions.sh         # build the venvs, run nothing
#   VENV_oldest=/path/to/venv scripts/test_versions.sh oldest   # reuse a venv you built
#
# Corners (torch 2.13.0 is the CPU wheel pip finds locally here; the others are PyPI's CUDA
# builds, several GB each, which run on the CPU too):
#   oldest        transformers 4.56.2, accelerate 1.10.1, peft 0.17.0 (the floors), torch 2.13.0
#   t457          transformers 4.57.x (newest 4.x), torch 2.13.0
#   newest        the newest releases pyproject.toml allows, torch 2.13.0 (what CI installs)
#   lf            LLaMA-Factory 0.9.5 with its pins (transformers 5.6.0, accelerate 1.11.0,
#                 peft 0.18.1, trl 0.24.0), torch 2.11.0 + torchaudio 2.11.0 + torchvision 0.26.0
#                 (LLaMA-Factory imports torchaudio, which has no CPU build nor a release past 2.11)
#   torch-oldest  torch 2.9.1 (the floor), newest transformers
#   torch-newest  torch 2.15.0, newest transformers
#
# Venvs go to $MATRIX_DIR (default ~/.cache/hf-zero-matrix/<corner>) and are reused when present; results
# are appended to $MATRIX_DIR/results.md (one table row per corner).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
MATRIX_DIR="${MATRIX_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hf-zero-matrix}"
PYTHON="${PYTHON:-python3}"
ALL_CORNERS=(oldest t457 newest lf torch-oldest torch-newest)
SLOW_TESTS=(integration_tests/test_trainer_parity.py integration_tests/test_trainer_resume.py
            integration_tests/test_user_scripts.py)
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# What each corner installs: torch first (pip keeps an installed torch that satisfies a range),
# then the pinned stack, then hf-zero itself with its dependencies (so pip shows it resolves
# beside the pins without moving them: --dry-run output is checked below).
torch_of() {
  case "$1" in
    lf) echo "torch==2.11.0 torchaudio==2.11.0 torchvision==0.26.0" ;;
    torch-oldest) echo "torch==2.9.1" ;;
    torch-newest) echo "torch==2.15.0" ;;
    *) echo "torch==2.13.0" ;;
  esac
}
pins_of() {
  case "$1" in
    oldest) echo "transformers==4.56.2 accelerate==1.10.1 peft==0.17.0 trl==1.16.0" ;;
    t457) echo "transformers>=4.57,<4.58 trl==1.16.0" ;;
    lf) echo "llamafactory==0.9.5 transformers==5.6.0 accelerate==1.11.0 peft==0.18.1 trl==0.24.0" ;;
    *) echo "" ;;
  esac
}

build() {  # build (or reuse) the venv of corner $1 at $2
  local corner="$1" venv="$2" torch pins
  torch="$(torch_of "$corner")"
  pins="$(pins_of "$corner")"
  if [ ! -x "$venv/bin/python" ]; then
    echo "== $corner: building $venv ($torch; ${pins:-newest})"
    "$PYTHON" -m venv "$venv" || return 1
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q $torch || return 1
    if [ -n "$pins" ]; then
      # shellcheck disable=SC2086
      "$venv/bin/pip" install -q $torch $pins || return 1
    fi
    # hf-zero's own requirements must hold beside the pins: a dry run that would move one of
    # them is a failure of this corner (the issue's "resolves without moving them").
    # (A corner without pins, torch-oldest/-newest, takes hf-zero's newest stack: nothing to move.)
    local moves=""
    [ -n "$pins" ] && moves="$("$venv/bin/pip" install --dry-run -e "$REPO" 2>/dev/null | grep '^Would install' \
             | tr ' ' '\n' | grep -iE '^(torch|transformers|accelerate|peft|trl|llamafactory)-[0-9]' || true)"
    if [ -n "$moves" ]; then
      echo "== $corner: installing hf-zero would move: $moves" >&2
      return 1
    fi
    # The test extra pins TRL 1.16; LLaMA-Factory's corner keeps its TRL 0.24.
    if [ "$corner" = lf ]; then
      "$venv/bin/pip" install -q -e "$REPO" pytest pytest-timeout || return 1
    else
      "$venv/bin/pip" install -q -e "$REPO[test]" || return 1
    fi
  fi
  "$venv/bin/pip" install -q --no-deps -e "$REPO" >/dev/null || return 1
}

versions() {
  "$1/bin/python" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version
import sys
out = [f"python {sys.version.split()[0]}"]
for name in ("torch", "transformers", "accelerate", "peft", "trl", "llamafactory"):
    try:
        out.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        pass
print(", ".join(out))
EOF
}

summary() {  # pytest's closing line, without the '=' rulers
  grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$1" | tail -n 1 | sed -e 's/^=* *//' -e 's/ *=*$//'
}

run_corner() {
  local corner="$1" var venv log start quick slow="-" rc=0
  var="VENV_${corner//-/_}"
  venv="${!var:-$MATRIX_DIR/$corner}"
  mkdir -p "$MATRIX_DIR"
  log="$MATRIX_DIR/$corner.log"
  if ! build "$corner" "$venv" >"$log" 2>&1; then
    echo "== $corner: venv build failed (see $log)"
    echo "| $corner | build failed | | |" >>"$MATRIX_DIR/results.md"
    return 1
  fi
  local vers
  vers="$(versions "$venv")"
  echo "== $corner: $vers"
  [ -n "${BUILD_ONLY:-}" ] && return 0
  cd "$REPO" || return 1
  start=$SECONDS
  "$venv/bin/python" -m pytest -q -p no:warnings --durations=20 -m "not slow" tests integration_tests >"$log.quick" 2>&1 || rc=1
  quick="$(summary "$log.quick") ($((SECONDS - start)) s)"
  echo "   quick: $quick"
  if [ -z "${QUICK_ONLY:-}" ]; then
    local slow_tests=("${SLOW_TESTS[@]}")
    [ "$corner" = lf ] && slow_tests+=(integration_tests/test_llamafactory.py)
    start=$SECONDS
    "$venv/bin/python" -m pytest -q -p no:warnings "${slow_tests[@]}" >"$log.slow" 2>&1 || rc=1
    slow="$(summary "$log.slow") ($((SECONDS - start)) s)"
    echo "   2-rank: $slow"
  fi
  echo "| $corner | $vers | $quick | $slow |" >>"$MATRIX_DIR/results.md"
  return $rc
}

corners=("$@")
[ ${#corners[@]} -eq 0 ] && corners=("${ALL_CORNERS[@]}")
failed=()
for corner in "${corners[@]}"; do
  case " ${ALL_CORNERS[*]} " in
    *" $corner "*) ;;
    *) echo "unknown corner '$corner'; corners: ${ALL_CORNERS[*]}" >&2; exit 2 ;;
  esac
  run_corner "$corner" || failed+=("$corner")
done
echo "results: $MATRIX_DIR/results.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed corners: ${failed[*]} (logs in $MATRIX_DIR)" >&2
  exit 1
fi
