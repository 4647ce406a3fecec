#!/bin/sh
# The sandbox's toolchains beside Python, from Debian packages: C++ (g++), Java (OpenJDK 17),
# JavaScript (node), Go, Rust and Bash. Installs what is missing (as root, with apt-get) and does
# nothing when every tool is present, so `make test` can run it each time. Used by `make toolchains`
# and by the sandbox's Dockerfile. Without root it names the packages to install and fails.
set -eu
missing=""
# Looked up on the sandbox runs' PATH (crucible_sandbox.judging.languages.RUN_PATH), not the
# caller's: a rustc under ~/.cargo/bin is not one the sandbox's runs can use.
need() { PATH=/usr/local/bin:/usr/bin:/bin command -v "$1" >/dev/null 2>&1 || missing="$missing $2"; }
need g++ g++
need javac openjdk-17-jdk-headless
need node nodejs
need go golang-go
need rustc rustc
need bash bash
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "toolchains: missing$missing; install them as root: apt-get install -y --no-install-recommends$missing" >&2
    exit 1
fi
echo "toolchains: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086  # one word per package
apt-get install -y -q --no-install-recommends $missing
