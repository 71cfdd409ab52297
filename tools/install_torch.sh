#!/usr/bin/env bash
# Installs one tested torch release, pinned by requirements/torch-<version>.txt, into a venv.
#   tools/install_torch.sh <venv python> <version>
# When pip cannot install it, stops with one message that names the version, the reason pip
# gave and the way out, instead of pip's resolver dump alone (the full log stays on disk).
set -u
python=$1
version=$2
pins=requirements/torch-$version.txt
tested=$(cd requirements && ls torch-*.txt 2>/dev/null | sed 's/^torch-//; s/\.txt$//' | xargs)
others=$(echo "$tested" | tr ' ' '\n' | grep -vx "$version" | xargs)
if [ ! -f "$pins" ]; then
    echo "phi_torch_jit: torch $version is not a tested release (no $pins)." >&2
    echo "  Tested: ${tested}. Pick from those (make test TORCH_VERSIONS='...'), or add $pins." >&2
    exit 2
fi
log=$(mktemp "${TMPDIR:-/tmp}/pip-torch-$version.XXXXXX.log")
if "$python" -m pip install --progress-bar off -r "$pins" >"$log" 2>&1; then
    rm -f "$log"
    exit 0
fi
reason=$(grep -E '^ERROR: (Cannot|Could not|No matching)|The user requested' "$log" | grep -v ResolutionImpossible)
[ -n "$reason" ] || reason=$(tail -n 3 "$log")
{
    echo
    echo "phi_torch_jit: could not install torch==$version ($pins) with $python."
    echo "pip said:"
    echo "$reason" | sed 's/^/    /'
    if grep -q '(constraint)' "$log"; then
        echo "Why: a pip constraint file caps torch below $version (see 'pip config list':"
        echo "  on this project's machines it is /etc/xdg/pip/constraints.txt, torch<=2.14.1)."
        echo "Way out: lift the cap for this machine (rm -r /etc/xdg/pip), or test the other"
        echo "  tested releases only: make test TORCH_VERSIONS='$others'"
    else
        echo "Way out: check that the package registry is reachable and offers torch $version for"
        echo "  this Python, or test the other tested releases only:"
        echo "  make test TORCH_VERSIONS='$others'"
    fi
    echo "Full pip log: $log"
} >&2
exit 1
