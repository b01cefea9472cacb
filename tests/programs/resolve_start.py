"""Resolves the entry points of the ``.start`` file installed in ``argv[1]`` (a site-packages folder, appended to
``sys.path`` if missing) as Python 3.15's ``site`` does (``pkgutil.resolve_name``, then a call without arguments),
twice, then lets the ``.pth``'s line run too; reports the finders waiting for ``import vllm`` after each step and
every module imported (tests/activation/test_install_modes.py)."""

import json
import pkgutil
import sys

site_dir = sys.argv[1]
if site_dir not in sys.path:
    sys.path.append(site_dir)
entries = [ln.strip() for ln in open(site_dir + "/vllm-minicpm-hotfix.start", encoding="utf-8")
           if ln.strip() and not ln.lstrip().startswith("#")]


def waiting():
    return [f.source for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)]


before = waiting()
results = []
for ep in entries:
    fn = pkgutil.resolve_name(ep)
    results.append([ep, callable(fn), repr(fn()), repr(fn())])
after_start = waiting()
import _vllm_minicpm_hotfix_arm as m  # noqa: E402  (the .pth's line: the module is imported already, nothing happens)

pth_line = m.activate("pth")  # and arming explicitly again arms nothing twice
print(json.dumps({"entries": entries, "results": results, "before": before, "after_start": after_start,
                  "pth_line": pth_line, "after_pth": waiting(), "modules": sorted(sys.modules)}))
