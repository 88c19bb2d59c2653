"""Optional dependencies of the integrations, imported on first use."""
import importlib


def require(module: str, pip: str, what: str):
    """Import ``module`` or raise one ImportError line naming ``pip``, the package that
    provides it, and ``what`` needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs `{module}`, which is not importable ({e.msg}); "
                          f"install it with: pip install '{pip}'") from None
