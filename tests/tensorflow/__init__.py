import ast
from pathlib import Path


def worker_tf_checks() -> list[str]:
    """Names of the @check functions in worker_tf.py, read without importing TensorFlow."""
    tree = ast.parse(Path(__file__).with_name("worker_tf.py").read_text())
    return [f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and any(getattr(d, "id", None) == "check" for d in f.decorator_list)]
