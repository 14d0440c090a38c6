import ast
from pathlib import Path


def worker_torch_checks() -> list[str]:
    """Names of the @check functions in worker_torch.py, read without importing torch."""
    tree = ast.parse(Path(__file__).with_name("worker_torch.py").read_text())
    return [f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and any(getattr(d, "id", None) == "check" for d in f.decorator_list)]
