"""A loopback Kubernetes API for tests: pods run as local subprocesses (see docs/kubernetes.md)."""

from tests.k8s.server import ApiError, LoopbackKubernetes

__all__ = ["ApiError", "LoopbackKubernetes"]
