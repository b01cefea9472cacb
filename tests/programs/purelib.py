"""Print this interpreter's purelib site-packages directory (``sysconfig``), for ``support.venvs.site_packages``."""

import sysconfig

print(sysconfig.get_paths()["purelib"])
