"""``import wrapt`` made to work: the installed wrapt if there is one, else the pure-Python copy a bundle ships.

A leaf: it imports only the standard library, so the activation (:mod:`vllm_minicpm_hotfix._bootstrap`) and the
proxies of the fixes (:mod:`vllm_minicpm_hotfix.fixes._proxies`) both use it without importing each other.
"""

import os
import sys

#: Folder, next to the package, where a bundle keeps its pure-Python wrapt (see :mod:`vllm_minicpm_hotfix.cli.bundle`).
VENDOR_DIR = "_vllm_minicpm_hotfix_vendor"


def ensure_wrapt():
    """Make ``import wrapt`` work: an installed wrapt always wins; only when the environment has none is the bundle's
    copy in ``<bundle>/_vllm_minicpm_hotfix_vendor`` appended to the *end* of ``sys.path``. Never raises."""
    try:
        import wrapt  # noqa: F401
        return
    except ImportError:
        pass
    vendor = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), VENDOR_DIR)
    if os.path.isdir(vendor) and vendor not in sys.path:
        sys.path.append(vendor)
