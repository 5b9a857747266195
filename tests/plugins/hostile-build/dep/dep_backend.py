"""The sdist dependency's in-tree PEP 517 back-end: probes at import, then builds."""

from hostile_common import HERE, build, probe

probe("sdist")


def get_requires_for_build_wheel(config_settings=None):
    return []


get_requires_for_build_sdist = get_requires_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = {"hostile_dep/__init__.py": (HERE / "hostile_dep" / "__init__.py").read_bytes()}
    return build(wheel_directory, "hostile_dep", "1.0.0", files, [], {})
