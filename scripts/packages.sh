# Sourced by scripts/setup.sh and scripts/setup_cuda.sh (which define say and die): install the missing
# Debian packages when running as root with apt, else stop with the command that would.
#   apt_install TARGET [PACKAGE...]     TARGET: the make target to rerun, named in the message
apt_install() {
    local target="$1"
    shift
    (($#)) || return 0
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        say "installing system packages: $*"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
    else
        die "missing system packages: $*. Install them (Debian/Ubuntu: sudo apt-get install $*) and rerun make $target"
    fi
}
