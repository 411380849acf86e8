"""Packs what CMake built into a wheel (scripts/build_wheel.sh runs this in a copy of this folder).

CMAKE_BINARY_DIR names the CMake build folder. The wheel holds the extension modules cohort_torch
and cohort_ps (top-level, as `import cohort_torch` expects), the `cohort` tool, which a virtual
environment gets as `bin/cohort`, and the package `cohort` (`python3 -m cohort.launch`). The modules are built for one Python and one torch (those
CMake found): the wheel's tag names the Python; torch comes from the environment (Debian's
python3-torch through --system-site-packages), not from the wheel's requirements.
"""
import glob
import os
import re
import shutil

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ["CMAKE_BINARY_DIR"]
MODULES = sorted(glob.glob(os.path.join(BUILD, "integrations", "python", "cohort_*.so")))
TOOL = os.path.join(BUILD, "tools", "cohort")
if not MODULES:
    raise SystemExit(f"no cohort_torch/cohort_ps module in {BUILD}/integrations/python: build them first")
with open(os.path.join(BUILD, "generated", "cohort", "version.h")) as f:
    VERSION = re.search(r'#define COHORT_VERSION "([^"]+)"', f.read()).group(1)


class PrebuiltModules(build_ext):
    """build_ext that compiles nothing: it copies the modules CMake built into the wheel's root."""

    def run(self):
        os.makedirs(self.build_lib, exist_ok=True)
        for module in MODULES:
            shutil.copy2(module, os.path.join(self.build_lib, os.path.basename(module)))
        # Beside the packages: puts cohort/horovod_shim (the `horovod` name, used where Horovod is not
        # installed) at the end of sys.path, so that no file of an installed Horovod is overwritten.
        shutil.copy2(os.path.join(HERE, "cohort-horovod.pth"), os.path.join(self.build_lib, "cohort-horovod.pth"))


class BinaryDistribution(Distribution):
    """Platform-specific: the wheel is tagged with this Python's ABI and the machine."""

    def has_ext_modules(self):
        return True


setup(
    name="cohort",
    version=VERSION,
    description="cohort: a distributed training runtime (PyTorch backend 'cohort', parameter server, launcher)",
    long_description=open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # `python3 -m cohort.launch`: torch.distributed.launch's line, handed to the tool (cohort/launch.py).
    # cohort.horovod.torch: Horovod's PyTorch API over cohort (docs/horovod.md).
    packages=["cohort", "cohort.horovod", "cohort.horovod.torch", "cohort.horovod.torch.ops",
              "cohort.horovod.torch.elastic",
              # `import horovod.torch` where Horovod is not installed (cohort-horovod.pth, docs/horovod.md).
              "cohort.horovod_shim.horovod", "cohort.horovod_shim.horovod.torch"],
    # The tool is an ELF program, not a script setuptools could rewrite: data, into the environment's bin/.
    data_files=[("bin", [TOOL])],
    cmdclass={"build_ext": PrebuiltModules},
    distclass=BinaryDistribution,
    zip_safe=False,
)
