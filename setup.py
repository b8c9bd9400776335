"""Package discovery for the ``smp2ds`` namespace (metadata lives in pyproject.toml).

Each top-level folder installs under a name of its own (``engine/`` -> ``smp2ds.engine``), so
nothing generic lands in site-packages; setuptools finds every subpackage below those folders.
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {
    "smp2ds.cli": "cli",
    "smp2ds.translator": "translator",
    "smp2ds.engine": "engine",
    "smp2ds.schemas": "schemas",
    "smdistributed": "smdistributed",
}

packages = []
for name, folder in PACKAGE_DIRS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(package_dir=PACKAGE_DIRS, packages=packages)
