"""Helpers for the deployment tests: compose files, Kustomize, Dockerfiles and who reads which variable."""
