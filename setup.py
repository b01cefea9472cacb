"""Build hooks that pyproject.toml cannot express (all metadata lives in pyproject.toml).

1. ``vllm-minicpm-hotfix.pth`` goes to the *root* of the wheel, i.e. into site-packages next to the package, where
   ``site`` runs it at every interpreter start-up (vllm_minicpm_hotfix/_bootstrap.py says what it does there).
   ``build_py`` writes it at the root of ``build_lib``, which ``bdist_wheel`` packs as the wheel's root. For a PEP 660
   editable install (``pip install -e .``, setuptools >= 64) ``build_lib`` is a throwaway folder and setuptools packs
   the folder the ``install`` command's ``install_lib`` points at instead, so the ``.pth`` is written there.
2. The top-level ``sitecustomize.py`` is copied into the package as ``_sitecustomize.py.txt`` (not importable), so
   ``vllm-minicpm-hotfix bundle`` run from a pip install can write it into a bundle. An editable install reads the
   repository's own file.
3. The sdist carries both files, so a wheel built from it (``uv build``, ``pip wheel`` of the sdist) has them too.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "vllm_minicpm_hotfix"
PTH = "vllm-minicpm-hotfix.pth"
SITECUSTOMIZE = "sitecustomize.py"
SITECUSTOMIZE_IN_PACKAGE = "_sitecustomize.py.txt"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            root = self.get_finalized_command("install").install_lib
            self.mkpath(root)
            self.copy_file(os.path.join(HERE, PTH), os.path.join(root, PTH))
            return
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))
        self.copy_file(
            os.path.join(HERE, SITECUSTOMIZE), os.path.join(self.build_lib, PACKAGE, SITECUSTOMIZE_IN_PACKAGE)
        )

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [
            os.path.join(self.build_lib, PTH),
            os.path.join(self.build_lib, PACKAGE, SITECUSTOMIZE_IN_PACKAGE),
        ]


class sdist_with_extras(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        for name in (PTH, SITECUSTOMIZE):
            self.copy_file(os.path.join(HERE, name), os.path.join(base_dir, name))


setup(cmdclass={"build_py": build_py_with_pth, "sdist": sdist_with_extras})
