"""A stand-in image ``sitecustomize`` that fails (tests/activation/test_activation.py copies it over
``image_site``'s): start-up must go on."""

raise RuntimeError("image sitecustomize broke")
