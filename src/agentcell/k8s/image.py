"""The recipe of the image a rendered pod runs (``agentcell k8s image``): Debian 12, what agentcell's cells need from
Debian (the packages scripts/setup.sh installs on a machine), and agentcell from the checkout it is built in.
A harness other than shell or scripted (Claude Code, Codex, ...) is installed in an image built FROM this one.
"""
from __future__ import annotations

from .render import OWNER_UID

BASE = "docker.io/library/debian:12"
# scripts/setup.sh's APT_PACKAGES (a test keeps the two alike), but python3-dev (agentcell's dependencies come
# as wheels) and gcc and libc6-dev (they build the compiled front, front/agentcell.c: a pod's supervisor runs
# once per session, and its `agentcell` is the Python CLI), and spin (the test suite's model checker,
# model/lifecycle.pml); ca-certificates for the clone and the proxy's upstreams.
APT_PACKAGES = ("python3", "python3-venv", "acl", "iproute2", "nftables", "bubblewrap", "procps", "util-linux",
                "libseccomp2", "git", "ca-certificates")


def containerfile() -> str:
    packages = " ".join(APT_PACKAGES)
    return f"""\
# agentcell's in-pod supervisor image. In an agentcell checkout:
#   agentcell k8s image > Containerfile
#   podman build -t REGISTRY/agentcell:TAG -f Containerfile .   (or docker build)
# then 'agentcell k8s render --image REGISTRY/agentcell:TAG'.
FROM {BASE}
RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {packages} \\
 && rm -rf /var/lib/apt/lists/*
# The project's owner: a session refuses a project root owns (the pod's init container gives it to this account).
RUN useradd --uid {OWNER_UID} --user-group --create-home --shell /bin/bash agent
COPY pyproject.toml README.md /usr/src/agentcell/
COPY bin /usr/src/agentcell/bin
COPY src /usr/src/agentcell/src
# Debian's python3, not another: the cell's accounts execute the venv's python (as scripts/setup.sh says).
RUN python3 -m venv /opt/agentcell \\
 && /opt/agentcell/bin/pip install --no-cache-dir /usr/src/agentcell \\
 && ln -s /opt/agentcell/bin/agentcell /usr/local/bin/agentcell \\
 && agentcell --help >/dev/null
"""
