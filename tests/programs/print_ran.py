"""Prints ``ran``: start-up went on to run the program (tests/activation/test_activation.py, a broken install's ``.pth``)."""

print("ran")
