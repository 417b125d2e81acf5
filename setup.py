"""Maps the card's top-level folders onto the ``omnirt`` import namespace.

``codecs/`` cannot be a top-level package (the standard library owns that name), so every
folder installs as ``omnirt.<folder>``; subpackages are found automatically.
"""

from setuptools import find_packages, setup

TOP_LEVEL = ["realtime", "sessions", "vad", "stages", "codecs", "kernels", "web_ui"]

packages: list[str] = []
for top in TOP_LEVEL:
    packages.append(f"omnirt.{top}")
    packages.extend(f"omnirt.{top}.{sub}" for sub in find_packages(top))

setup(
    packages=packages,
    package_dir={f"omnirt.{top}": top for top in TOP_LEVEL},
    package_data={
        "omnirt.web_ui": ["static/*", "static/**/*"],
        "omnirt.stages.diffusion.cache": ["calibrations/*"],
    },
)
