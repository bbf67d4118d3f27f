"""The flag names OpenRLHF's train_ppo_ray.py declares, in source order, read from its AST (nothing imported).

    python scripts/openrlhf_flags.py path/to/openrlhf/cli/train_ppo_ray.py > tests/data/openrlhf_flags/vX.txt

Every add_argument's first option string, without the leading dashes; f-strings inside
`for prefix in ("actor", "critic"):` loops (OpenRLHF 0.11's per-role optimizer flags) are expanded per value.
tests/data/openrlhf_flags/ holds the lists of v0.10.1 and v0.11.0 (git tags of github.com/OpenRLHF/OpenRLHF) and of
0.11.2 (the PyPI wheel), each with the command that made it; tests/unit/test_openrlhf_flag_lists.py checks that orlhf
knows every name.
"""

import ast
import sys


def flags(path: str) -> list[str]:
    tree = ast.parse(open(path).read())
    out: list[str] = []

    def text(node, env):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.Constant):
                    parts.append(v.value)
                elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id in env:
                    parts.append(env[v.value.id])
                else:
                    return None
            return "".join(parts)
        return None

    def visit(node, env):
        loop = isinstance(node, ast.For) and isinstance(node.target, ast.Name)
        if loop and isinstance(node.iter, (ast.Tuple, ast.List)):
            for value in [e.value for e in node.iter.elts if isinstance(e, ast.Constant)]:
                for child in node.body:
                    visit(child, {**env, node.target.id: value})
            return
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            for a in node.args:
                t = text(a, env)
                if t and t.startswith("--"):
                    out.append(t[2:])
                    break
        for child in ast.iter_child_nodes(node):
            visit(child, env)

    visit(tree, {})
    return out


if __name__ == "__main__":
    names = flags(sys.argv[1])
    print("\n".join(names))
