"""The package's own in-tree PEP 517 back-end (``backend-path = ["."]``): probes at import, then builds."""

from hostile_common import HERE, build, probe

probe("backend")


def get_requires_for_build_wheel(config_settings=None):
    return []


get_requires_for_build_editable = get_requires_for_build_wheel
get_requires_for_build_sdist = get_requires_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = {"hostile_plugin.py": (HERE / "hostile_plugin.py").read_bytes()}
    return build(wheel_directory, "hostile_build", "1.0.0", files, ["hostile-dep"],
                 {"hostile-build": "hostile_plugin:main"})


build_editable = build_wheel
