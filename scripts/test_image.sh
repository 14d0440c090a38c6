#!/usr/bin/env bash
# `make docker-test`: build the Dockerfile for real with buildah and run the image's default CMD (the main
# job on 2 ranks) as its non-root user; pass only if the job's result line says test_accuracy >= 0.97 on
# world_size 2 and `id -u` in the container is not 0.
#
# No registry is needed: the base image is a Debian bookworm minbase made with debootstrap from the apt
# mirror this machine uses, cached in $HVDP_CACHE_DIR/images (default ~/.cache/hvdp). The framework wheels
# and the Horovod wheel `make setup` built reach the build through docker/wheels (hard links, removed
# afterwards), so a cold run downloads ~600 MB once and compiles nothing.
#
# HVDP_DEVICE=cuda (`make docker-test-cuda`) builds the CUDA variant instead (PyTorch, torch 2.11's CUDA 13
# build, NCCL from pip; Horovod compiled inside the build with NCCL, ~5 min) and also checks that its
# Horovod lists NCCL, PyTorch, MPI and Gloo. The job itself runs on the CPU: this machine has no GPU.
#
# Environment: HVDP_IMAGE (default localhost/hvdp:test, localhost/hvdp:cuda-test for cuda), HVDP_BASE_IMAGE (use this base instead of the
# debootstrap one), HVDP_PIP_CERT (CA bundle for pip inside the build; default: the system bundle),
# HVDP_DOCKER_NO_CACHE=1 (rebuild every layer), HVDP_DEBIAN_MIRROR (default: from apt's sources).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cache="${HVDP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdp}"
export HVDP_DEVICE="${HVDP_DEVICE:-cpu}"
case "$HVDP_DEVICE" in
    cpu) IMAGE="${HVDP_IMAGE:-localhost/hvdp:test}" ;;
    cuda) IMAGE="${HVDP_IMAGE:-localhost/hvdp:cuda-test}" ;;
    *) echo "[docker-test] error: HVDP_DEVICE=$HVDP_DEVICE: use cpu or cuda" >&2; exit 2 ;;
esac
VPY="${VENV:-$root/.venv}/bin/python"
t0=$SECONDS
say() { printf '\033[1m[docker-test %3ds]\033[0m %s\n' "$((SECONDS - t0))" "$*"; }
die() { printf '[docker-test] error: %s\n' "$*" >&2; exit 1; }

# 1. Tools.
missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || [[ -n "${HVDP_BASE_IMAGE:-}" ]] || missing+=(debootstrap)
source scripts/packages.sh
apt_install docker-test "${missing[@]}"
[[ $(id -u) == 0 ]] || die "buildah --isolation chroot and debootstrap need root here; run make docker-test as root"
[[ -x $VPY ]] || die "$VPY is missing; run make setup first"

# Everything this run creates outside the cache is removed on exit.
ctrs=()
cleanup() {
    for c in "${ctrs[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
    find "$root/docker/wheels" -mindepth 1 ! -name README.md -delete 2>/dev/null || true
    [[ -n "${rootfs:-}" ]] && rm -rf "$rootfs"
    [[ -n "${cons:-}" ]] && rm -f "$cons"
    return 0
}
trap cleanup EXIT

# 2. The base image: Debian bookworm minbase from the configured mirror, built once and cached as a tarball.
if [[ -n "${HVDP_BASE_IMAGE:-}" ]]; then
    base="$HVDP_BASE_IMAGE"
else
    mirror="${HVDP_DEBIAN_MIRROR:-}"
    if [[ -z $mirror ]]; then
        # one-line sources: "deb URL bookworm main"; deb822: a stanza with "Suites: bookworm ..." and "URIs:".
        mirror="$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } \
                  | awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}')"
        [[ -n $mirror ]] || mirror="$({ cat /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } | awk '
            /^$/ {if (uri && suite) {print uri; exit}; uri = ""; suite = 0}
            /^URIs:/ {uri = $2}
            /^Suites:/ {for (i = 2; i <= NF; i++) if ($i == "bookworm") suite = 1}
            END {if (uri && suite) print uri}' | head -1)"
        mirror="${mirror:-http://deb.debian.org/debian}"
    fi
    key="bookworm-minbase-$(printf %s "$mirror" | sha256sum | cut -c1-8)"
    base="localhost/hvdp-base:$key"
    tarball="$cache/images/$key.tar"
    if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
        if [[ ! -s $tarball ]]; then
            say "making the base image: debootstrap --variant=minbase bookworm from $mirror (~1-2 min, once)"
            mkdir -p "$cache/images"
            rootfs="$(mktemp -d "$cache/images/rootfs.XXXXXX")"
            debootstrap --variant=minbase bookworm "$rootfs" "$mirror" > "$cache/images/$key.log" 2>&1 \
                || die "debootstrap failed; see $cache/images/$key.log"
            tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
            rm -rf "$rootfs"; rootfs=
        fi
        say "importing $tarball as $base"
        c="$(buildah from scratch)"; ctrs+=("$c")
        buildah add --quiet "$c" "$tarball" / >/dev/null
        buildah config --cmd /bin/bash "$c"
        buildah commit --quiet --rm "$c" "$base" >/dev/null
        ctrs=("${ctrs[@]/$c}")
    fi
fi
say "base image: $base"

# 3. The build context's wheels: the pinned frameworks (downloaded once per constraints.txt and python) and
#    the Horovod wheel make setup built. A host python other than the image's only costs the shortcut.
pyver="$("$VPY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
cons="$(mktemp)"
bash docker/image.sh constraints > "$cons"
wkey="$({ cat "$cons"; bash docker/image.sh packages; } | sha256sum | cut -c1-12)-$pyver-$(uname -m)"
wheels="$cache/image-wheels/$wkey"
if [[ ! -e $wheels/.complete ]]; then
    say "downloading the framework wheels into $wheels (~600 MB for cpu, ~4 GB for cuda; once)"
    mkdir -p "$wheels"
    mapfile -t reqs < <(bash docker/image.sh packages)
    "$VPY" -m pip download -q -d "$wheels" -c "$cons" "${reqs[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
    "$VPY" -m pip download -q -d "$wheels" --no-deps --no-binary mpi4py \
        "mpi4py==$(sed -n 's/^mpi4py==//p' constraints.txt)" 2> >(grep -v "is ignored: it is neither" >&2)
    touch "$wheels/.complete"
fi
find docker/wheels -mindepth 1 ! -name README.md -delete
cp -l "$wheels"/* docker/wheels/ 2>/dev/null || cp "$wheels"/* docker/wheels/
if [[ $HVDP_DEVICE == cpu ]]; then  # the CUDA variant's Horovod (NCCL, no TensorFlow) is compiled in the build
    hwheel="$(PYTHON="$VPY" bash scripts/build_horovod.sh | tail -1)"
    mkdir -p "docker/wheels/horovod/$(basename "$(dirname "$hwheel")")"
    cp -l "$hwheel" "docker/wheels/horovod/$(basename "$(dirname "$hwheel")")/" 2>/dev/null \
        || cp "$hwheel" "docker/wheels/horovod/$(basename "$(dirname "$hwheel")")/"
fi
say "build context: $(du -shL docker/wheels | cut -f1) of wheels"

# 4. Build. pip inside the build sees the host's CA bundle (mounted, build time only) in case it needs the index.
cert="${HVDP_PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
certargs=()
[[ -s $cert ]] && certargs=(-v "$cert:/host-ca.crt:ro" --build-arg PIP_CERT=/host-ca.crt)
layers=(--layers)
[[ "${HVDP_DOCKER_NO_CACHE:-0}" == 1 ]] && layers=(--layers --no-cache)
say "buildah bud -t $IMAGE --build-arg BASE_IMAGE=$base --build-arg HVDP_DEVICE=$HVDP_DEVICE ."
tb=$SECONDS
buildah bud --isolation chroot --force-rm "${layers[@]}" "${certargs[@]}" --build-arg BASE_IMAGE="$base" \
    --build-arg HVDP_DEVICE="$HVDP_DEVICE" -t "$IMAGE" -f Dockerfile . \
    || die "image build failed"
build_s=$((SECONDS - tb))
find docker/wheels -mindepth 1 ! -name README.md -delete
size="$(buildah images --format '{{.Size}}' "$IMAGE" | head -1)"
say "built $IMAGE in ${build_s}s ($size)"

# 5. Run the image's own CMD, as its own USER (uid 1000, not root), and check what it printed.
c="$(buildah from --quiet "$IMAGE")"; ctrs+=("$c")
user="$(buildah inspect --type image --format '{{.OCIv1.Config.User}}' "$IMAGE")"
uid="$(buildah run --isolation chroot --user "$user" "$c" -- id -u)"
[[ -n $user && $uid != 0 ]] || die "the image runs as uid $uid (USER '$user'); it must not be root"
mapfile -t cmd < <(buildah inspect --type image --format '{{range .OCIv1.Config.Cmd}}{{println .}}{{end}}' "$IMAGE" | sed '/^$/d')
say "running as $user (uid $uid): ${cmd[*]}"
tr=$SECONDS
log="$(mktemp)"
# horovodrun's MPI mode prefixes each line with "[1,RANK]<stdout>:".
buildah run --isolation chroot --user "$user" "$c" -- "${cmd[@]}" 2>&1 | sed -E 's/^\[[0-9]+,[0-9]+\]<std(out|err)>://' \
    | tee "$log" | grep -E '^(result:|epoch [0-9]+:|training)' || true
run_s=$((SECONDS - tr))
result="$(grep '^result: ' "$log" | tail -1 || true)"
[[ -n $result ]] || { tail -40 "$log"; rm -f "$log"; die "the job printed no result line"; }
rm -f "$log"
"$VPY" - "$result" <<'PY' || die "the job's result is not good enough: $result"
import json, sys
r = json.loads(sys.argv[1].removeprefix("result: "))
ok = r["world_size"] == 2 and r["test_accuracy"] >= 0.97
print(f"world_size {r['world_size']} (want 2), test_accuracy {r['test_accuracy']} (want >= 0.97)")
sys.exit(not ok)
PY
if [[ $HVDP_DEVICE == cuda ]]; then  # what Horovod was built with, as horovodrun lists it
    check="$(buildah run --isolation chroot --user "$user" "$c" -- horovodrun --check-build 2>&1)"
    echo "$check" | sed -n '/Available Frameworks/,$p'
    for what in PyTorch MPI Gloo NCCL; do
        grep -q "\[X\] $what" <<<"$check" || die "the CUDA image's Horovod lacks $what"
    done
    if grep -q "\[X\] TensorFlow" <<<"$check"; then die "the CUDA image's Horovod has TensorFlow: it is PyTorch only"; fi
fi
say "ok: build ${build_s}s, job ${run_s}s, total $((SECONDS - t0))s; image $IMAGE $size, user $user uid $uid"
