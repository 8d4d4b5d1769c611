"""Optional packages (pyproject's extras): what each is called, and the one-line error that
names the install command when code that needs one finds it missing."""

from __future__ import annotations

import importlib
import importlib.util

# import name -> (the package's name, the command that installs it from a checkout)
EXTRAS = {
    "ray": ("Ray", "pip install -e '.[ray]'"),
    "lm_eval": ("lm-eval", "pip install -e '.[eval]'"),
    "peft": ("PEFT", "pip install -e '.[bench]'"),
}


class MissingPackage(ImportError):
    """An optional package is not installed (or does not import); the message names what
    needs it and the pip command. The command line prints it as one line."""


def require(module: str, needed_by: str) -> None:
    """Imports ``module`` (one of ``EXTRAS``) or raises ``MissingPackage``: "<needed_by> needs
    <package>: <pip command>"."""
    name, command = EXTRAS[module]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        installed = _installed(module)
        why = f", which is installed but does not import ({exc})" if installed else ""
        raise MissingPackage(f"{needed_by} needs {name}{why}: {command}") from None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent
        return False
