"""A stand-in for an image's own ``sitecustomize`` (Debian/Ubuntu Pythons and many images ship one), copied into a
folder of its own by the tests that put one after ours on ``PYTHONPATH``: it marks that it ran, under its own
module name (tests/programs/started.py reports the mark)."""

import sys

sys.image_sitecustomize_ran = __name__
