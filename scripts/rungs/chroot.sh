# Debian chroots for the slow rung's other platforms (docs/platforms.md): sourced by the rung scripts beside it.
#
#   make_chroot DIR SUITE ARCH [PACKAGE...]
#                                debootstrap a minimal Debian SUITE for ARCH (amd64, arm64) into DIR once, with this
#                                machine's apt, pip and CA settings, python3 with venv and pip, and the PACKAGEs
#   in_chroot DIR CMD...         run CMD inside DIR as root, with /proc, /sys, /dev and /tmp mounted, the host's
#                                network (so loopback is shared with processes outside) and its PIP_* settings
#   register_qemu ARCH           let the kernel run ARCH's programs through qemu-user-static (binfmt_misc)
#
# Needs root, debootstrap and, for a foreign ARCH, qemu-user-static; each function says what is missing.
set -euo pipefail

rung_fail() { echo "rung: $*" >&2; exit 2; }

need_root_tools() {
    [ "$(id -u)" = 0 ] || rung_fail "needs root (chroot, mounts): run it with sudo"
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null || rung_fail "needs $t (apt-get install $(tool_package "$t"))"
    done
}

tool_package() {
    case $1 in
        qemu-aarch64-static) echo qemu-user-static ;;
        aarch64-linux-gnu-gcc) echo gcc-aarch64-linux-gnu ;;
        aarch64-linux-gnu-g++) echo g++-aarch64-linux-gnu ;;
        *) echo "$1" ;;
    esac
}

register_qemu() {
    local arch=$1 conf name
    [ "$arch" = "$(dpkg --print-architecture)" ] && return 0
    need_root_tools "qemu-$(qemu_name "$arch")-static"
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    name="qemu-$(qemu_name "$arch")"
    [ -e "/proc/sys/fs/binfmt_misc/$name" ] && return 0
    conf=/usr/lib/binfmt.d/$name.conf
    [ -f "$conf" ] || rung_fail "$conf is missing (apt-get install qemu-user-static)"
    # its F flag opens the interpreter now, so that it also runs inside chroots
    grep -v '^#' "$conf" > /proc/sys/fs/binfmt_misc/register
}

qemu_name() { case $1 in arm64) echo aarch64 ;; *) echo "$1" ;; esac; }

make_chroot() {
    local dir=$1 suite=$2 arch=$3
    shift 3
    local packages="ca-certificates python3 python3-venv python3-pip procps $*"
    if [ -f "$dir/.rung-ready" ]; then
        [ "$(cat "$dir/.rung-ready")" = "$packages" ] && return 0
        register_qemu "$arch"
        in_chroot "$dir" sh -c "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            $packages >/dev/null" >>"$dir.log" 2>&1 || rung_fail "apt-get in the chroot failed; see $dir.log"
        echo "$packages" > "$dir/.rung-ready"
        return 0
    fi
    need_root_tools debootstrap
    register_qemu "$arch"
    rm -rf "$dir" && mkdir -p "$dir"
    echo "rung: debootstrap $suite ($arch) into $dir (a few minutes, once)"
    debootstrap --arch="$arch" --variant=minbase "$suite" "$dir" http://deb.debian.org/debian >"$dir.log" 2>&1 \
        || rung_fail "debootstrap failed; see $dir.log"
    # the host's apt, pip and certificate settings: without them apt and pip cannot reach their mirrors here
    cp /etc/apt/apt.conf.d/99* "$dir/etc/apt/apt.conf.d/" 2>/dev/null || true
    [ -f /etc/pip.conf ] && cp /etc/pip.conf "$dir/etc/pip.conf"
    mkdir -p "$dir/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$dir/usr/local/share/ca-certificates/" 2>/dev/null || true
    cp /etc/resolv.conf "$dir/etc/resolv.conf"
    in_chroot "$dir" sh -c "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends $packages >/dev/null && update-ca-certificates >/dev/null" >>"$dir.log" 2>&1 \
        || rung_fail "apt-get in the chroot failed; see $dir.log"
    echo "$packages" > "$dir/.rung-ready"
}

_mounts() {
    local dir=$1
    mountpoint -q "$dir/proc" || mount -t proc proc "$dir/proc"
    mountpoint -q "$dir/sys" || mount --rbind /sys "$dir/sys"
    mountpoint -q "$dir/dev" || mount --rbind /dev "$dir/dev"
    mountpoint -q "$dir/tmp" || mount -t tmpfs tmpfs "$dir/tmp"
    local links
    for links in ${PIP_FIND_LINKS:-}; do  # local wheel folders that pip is told to look in: the same, read-only
        [ -d "$links" ] || continue
        mkdir -p "$dir$links"
        mountpoint -q "$dir$links" || { mount --bind "$links" "$dir$links" && mount -o remount,bind,ro "$dir$links"; }
    done
}

# copy_tree DIR: this working tree as git sees it (tracked and new files, nothing ignored) into DIR, over the last
# copy; DIR's .venv stays (its engine is cached in the chroot's own cache anyway)
copy_tree() {
    local dest=$1
    mkdir -p "$dest"
    find "$dest" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
    git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$dest"
}

# cache_root: primaplug's cache folder (engine/build.py's cache_location: $PRIMAPLUG_CACHE, $XDG_CACHE_HOME/primaplug
# or ~/.cache/primaplug), where the rungs keep their chroots
cache_root() { echo "${PRIMAPLUG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/primaplug}"; }

unmount_chroot() {
    local dir=$1 m
    for m in ${PIP_FIND_LINKS:-} /tmp /dev /sys /proc; do
        mountpoint -q "$dir$m" && umount -R -l "$dir$m" || true
    done
}

in_chroot() {
    local dir=$1
    shift
    _mounts "$dir"
    local envs=(HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
                PIP_ROOT_USER_ACTION=ignore)
    local v
    for v in $(compgen -e | grep -E '^(PIP_|QEMU_CPU$|PRIMAPLUG_)' || true); do
        envs+=("$v=${!v}")
    done
    chroot "$dir" /usr/bin/env -i "${envs[@]}" "$@"
}
