#!/bin/sh
# Install primaplug from this clone on Termux (Android), macOS or Linux: the system packages it needs, a virtual
# environment, primaplug itself, and its patched engine (built once, then cached in $PRIMAPLUG_CACHE, else
# ~/.cache/primaplug). POSIX sh: a fresh Termux has no Python yet. docs/install.md says what each step does.
#
#   sh scripts/install.sh              # all of it
#   sh scripts/install.sh --dry-run    # print the commands it would run, run none
#
# Options:
#   --gpu cpu|cuda|metal   the engine's backend (default: metal on Apple silicon, cuda on Linux where nvcc is
#                          on PATH or in $CUDA_HOME (/usr/local/cuda), else cpu)
#   --venv DIR             the virtual environment to create or reuse (default: .venv in this clone)
#   --extras LIST          primaplug's extras, comma-separated (default: dashboard; "" for none; server adds
#                          `primaplug serve`, which needs Rust on Termux)
#   --python PY            the Python 3.11+ that creates the environment (default: the newest found)
#   --no-system-packages   only check the system's packages, install none
#   --dry-run              print the commands, run none
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DRY=0 GPU= VENV= EXTRAS=dashboard PY= SYSPKGS=1

# Termux's packages: the compiler and build tools (llama.cpp's docs/android.md: cmake and libandroid-spawn too),
# numpy and psutil prebuilt (neither builds from PyPI's source for Termux's Python), libzmq and pkg-config so that
# pyzmq builds against Termux's libzmq (its bundled copy does not build for Android), ninja for the CMake builds
# (PyPI's cmake and ninja have no wheels for Termux)
TERMUX_PACKAGES="python python-pip python-numpy python-psutil clang cmake ninja make patch pkg-config binutils
libzmq libandroid-spawn"

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }
say() { printf 'install: %s\n' "$*"; }
die() { printf 'install: error: %s\n' "$*" >&2; exit 1; }
quote() {
    case $1 in
        '' | *[!A-Za-z0-9_./:=,+@%-]*) printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")" ;;
        *) printf '%s' "$1" ;;
    esac
}
# print a command as it would be typed, then run it (not with --dry-run)
run() {
    line=
    for arg; do line="$line${line:+ }$(quote "$arg")"; done
    printf '+ %s\n' "$line"
    [ "$DRY" = 1 ] || "$@"
}
have() { command -v "$1" >/dev/null 2>&1; }

while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY=1 ;;
        --gpu) [ $# -ge 2 ] || die "--gpu needs cpu, cuda or metal"; GPU=$2; shift ;;
        --gpu=*) GPU=${1#--gpu=} ;;
        --venv) [ $# -ge 2 ] || die "--venv needs a folder"; VENV=$2; shift ;;
        --venv=*) VENV=${1#--venv=} ;;
        --extras) [ $# -ge 2 ] || die "--extras needs a list (\"\" for none)"; EXTRAS=$2; shift ;;
        --extras=*) EXTRAS=${1#--extras=} ;;
        --python) [ $# -ge 2 ] || die "--python needs a program"; PY=$2; shift ;;
        --python=*) PY=${1#--python=} ;;
        --no-system-packages) SYSPKGS=0 ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown option $1 (--help lists them)" ;;
    esac
    shift
done
case $GPU in '' | cpu | cuda | metal) ;; *) die "--gpu $GPU: choose cpu, cuda or metal" ;; esac
VENV=${VENV:-$ROOT/.venv}
CACHE=${PRIMAPLUG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/primaplug}

# --- the platform ---------------------------------------------------------------------------------------------
if [ -n "${TERMUX_VERSION:-}" ] || case ${PREFIX:-} in */com.termux/files/usr) true ;; *) false ;; esac; then
    PLATFORM=termux
else
    case $(uname -s) in
        Darwin) PLATFORM=macos ;;
        Linux) PLATFORM=linux ;;
        *) die "$(uname -s) is not supported: primaplug installs on Termux (Android), macOS and Linux" ;;
    esac
fi
ARCH=$(uname -m)
say "platform: $PLATFORM ($ARCH)$([ "$DRY" = 1 ] && printf ', dry run: nothing is changed')"

# the first Python 3.11+ among the candidates: sets PY and PYINFO ("3.13 android")
python_info() { "$1" -c 'import sys; print("%d.%d %s" % (sys.version_info[0], sys.version_info[1], sys.platform))'; }
new_enough() { case $1 in 3.1[1-9]\ * | 3.[2-9][0-9]\ *) true ;; *) false ;; esac; }
find_python() {
    for candidate in "$@"; do
        have "$candidate" || continue
        info=$(python_info "$candidate" 2>/dev/null) || continue
        if new_enough "$info"; then PY=$candidate PYINFO=$info; return 0; fi
    done
    return 1
}

# --- system packages --------------------------------------------------------------------------------------------
case $PLATFORM in
termux)
    if [ "$SYSPKGS" = 1 ]; then
        # shellcheck disable=SC2086  # one word per package
        run pkg install -y $TERMUX_PACKAGES
    fi
    ;;
macos)
    if ! xcode-select -p >/dev/null 2>&1; then
        [ "$SYSPKGS" = 1 ] || die "the Xcode Command Line Tools (clang, make, patch) are missing: xcode-select --install"
        run xcode-select --install
        [ "$DRY" = 1 ] || die "the Xcode Command Line Tools (clang, make, patch) are being installed: run this again when they are"
    fi
    if ! have cmake; then
        [ "$SYSPKGS" = 1 ] && have brew || die "cmake is missing: install it (https://cmake.org/download or Homebrew: brew install cmake)"
        run brew install cmake
    fi
    ;;
linux)
    missing=
    have cc || have gcc || have clang || missing="$missing c-compiler"
    have c++ || have g++ || have clang++ || missing="$missing c++-compiler"
    for tool in cmake make patch; do have "$tool" || missing="$missing $tool"; done
    if [ -n "$missing" ]; then
        if have apt-get; then pkgs="build-essential cmake patch python3-venv"; cmd="apt-get install -y"
        elif have dnf; then pkgs="gcc gcc-c++ make cmake patch python3"; cmd="dnf install -y"
        elif have pacman; then pkgs="base-devel cmake patch python"; cmd="pacman -S --needed --noconfirm"
        else die "missing:$missing; install them with your system's package manager, then run this again"
        fi
        [ "$SYSPKGS" = 1 ] || die "missing:$missing; install them (e.g. sudo $cmd $pkgs), then run this again"
        sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
        say "missing:$missing"
        # shellcheck disable=SC2086
        run $sudo $cmd $pkgs
    fi
    ;;
esac

# --- Python -----------------------------------------------------------------------------------------------------
if [ -n "$PY" ]; then
    find_python "$PY" || die "$PY is not a Python 3.11 or newer"
elif [ "$PLATFORM" = termux ]; then
    find_python python python3 || die "Termux's python is older than 3.11 (or missing): pkg upgrade python"
else
    find_python python3.13 python3.12 python3.11 python3 python || {
        if [ "$PLATFORM" = macos ] && have brew && [ "$SYSPKGS" = 1 ]; then
            run brew install python@3.13
            PY="$(brew --prefix)/bin/python3.13" PYINFO="3.13 darwin"
        else
            die "primaplug needs Python 3.11 or newer: install it (python.org, Homebrew, or your package manager)"
        fi
    }
fi
say "python: $PY ($PYINFO)"
if [ "$PLATFORM" = termux ] && [ "${PYINFO#* }" != android ]; then
    say "warning: this Termux Python reports sys.platform '${PYINFO#* }', not 'android' (Python 3.13 and later do):"
    say "pip will then build highspy from source (long). pkg upgrade python first avoids it"
fi

# --- the engine's backend and flags -----------------------------------------------------------------------------
if [ -z "$GPU" ]; then
    case $PLATFORM-$ARCH in
        macos-arm64) GPU=metal ;;
        linux-*) if have nvcc || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then GPU=cuda; else GPU=cpu; fi ;;
        *) GPU=cpu ;;
    esac
fi
if [ "$GPU" = cuda ] && [ -z "${PRIMAPLUG_CMAKE_ARGS:-}" ]; then
    # kernels for this machine's GPU only: llama.cpp's default list of architectures takes many times longer
    PRIMAPLUG_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=native"
    export PRIMAPLUG_CMAKE_ARGS
fi
say "engine: $GPU$([ -n "${PRIMAPLUG_CMAKE_ARGS:-}" ] && printf ', PRIMAPLUG_CMAKE_ARGS=%s' "$PRIMAPLUG_CMAKE_ARGS")"

# --- the virtual environment and primaplug ----------------------------------------------------------------------
VPY=$VENV/bin/python
if [ -x "$VPY" ]; then
    say "reusing $VENV"
elif [ "$PLATFORM" = termux ]; then
    # Termux's own numpy and psutil (pkg) are seen from the environment; pip is Termux's python-pip
    run "$PY" -m venv --system-site-packages --without-pip "$VENV" || die "could not create $VENV"
else
    run "$PY" -m venv "$VENV" || die "could not create $VENV (Debian and Ubuntu: apt-get install python3-venv)"
fi
if [ "$PLATFORM" = termux ]; then
    say "highspy (Halda's solver) is left out on Termux (no package; a long source build). A node never uses it;"
    say "a head here plans with --scheduler even|memory|compute or --layers (pip install highspy adds it)"
fi
# editable: the environment follows the clone (git pull), as make setup's does, and shares .venv with it
TARGET=$ROOT
[ -n "$EXTRAS" ] && TARGET="$ROOT[$EXTRAS]"
run "$VPY" -m pip install -e "$TARGET"

# --- the engine -------------------------------------------------------------------------------------------------
say "building the engine: llama-cpp-python 0.3.36 with primaplug's llama.cpp patches ($GPU). This takes several"
say "minutes (about 4 on 2 desktop cores; longer on a phone: keep Termux awake, termux-wake-lock), once: the wheel"
say "and the build log go to $CACHE/engine, and later installs reuse it"
run "$VPY" -m primaplug engine build --gpu "$GPU"

say "done. The engine cache is $CACHE (PRIMAPLUG_CACHE moves it). Try:"
say "  $VPY -m primaplug engine status"
say "  $VPY -m primaplug run -p 'The three primary colors are' -n 16   # the bundled Gemma 3 270M"
