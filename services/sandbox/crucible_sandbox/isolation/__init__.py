"""Confinement of a run: the zygote that forks a run's processes (`zygote`), the slot's isolation it
sets up and each process enters (`confine`, whose docstring says what is and is not isolated), a
root of its own (`rootfs`), Landlock (`landlock`) and cgroups (`cgroups`)."""
