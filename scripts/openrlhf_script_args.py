"""The argument list an OpenRLHF launch script passes to openrlhf.cli.train_ppo_ray, one shell token per line, read
from the script's text (`git show` output on stdin; nothing of it is run).

    git show TAG:examples/scripts/X.sh | python scripts/openrlhf_script_args.py TAG examples/scripts/X.sh \\
        > tests/data/openrlhf_scripts/TAG/X.txt
    git show TAG:README.md | python scripts/openrlhf_script_args.py TAG README.md --readme N \\
        > tests/data/openrlhf_scripts/TAG/README-N.txt

What it reads of bash: `\\` line continuations, '...' and "..." quoting (backslash escapes inside double quotes),
comments, `NAME=value` and `NAME=( ... )` assignments (arrays over several lines, comment lines inside), and
$NAME / ${NAME} / ${NAME[@]} expansions with word splitting where unquoted. A command whose train_ppo_ray
sits inside a quoted string (`srun ... bash -c "... python3 -m openrlhf.cli.train_ppo_ray ..."`, the slurm script)
is read again from that string, as the inner bash would. A value the script computes ($(...), $((...))) is not run:
a variable the arguments need from one must be given with --set NAME=VALUE, else it is an error.

README.md (--readme N): the N-th train_ppo_ray command (1-based, in document order) in the ```bash blocks; a line
that is only `...` (the README's "other training args" placeholder, with or without a comment) is dropped and the
command goes on past it.

The first output line is `# TAG PATH: what was substituted | the command that made the file`.
tests/unit/test_openrlhf_scripts.py runs every file under tests/data/openrlhf_scripts/ through `orlhf plan`.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field

TARGET = "openrlhf.cli.train_ppo_ray"
OPERATOR_CHARS = "|&;<>()"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Unknown(str):
    """A value the script computes at run time ($(...), $((...)), an unset variable): known only by its text."""


class NotComputed(Exception):
    """An expansion needs an Unknown value."""


@dataclass
class Word:
    """One shell word before expansion: segments ("lit", text, quoted) | ("var", name, quoted, is_array) |
    ("cmd", raw, quoted)."""

    parts: list = field(default_factory=list)

    def lit(self, text: str, quoted: bool) -> None:
        last = self.parts[-1] if self.parts else None
        if last is not None and last[0] == "lit" and last[2] == quoted:
            self.parts[-1] = ("lit", last[1] + text, quoted)
        else:
            self.parts.append(("lit", text, quoted))


def tokenize(text: str) -> list:
    """Words (Word) and operators (str: "\\n", ";", "&&", "(", ")", "&>>", ...), as bash splits them."""
    out: list = []
    i, n = 0, len(text)
    word: Word | None = None

    def end_word():
        nonlocal word
        if word is not None:
            out.append(word)
            word = None

    def dollar(j: int, quoted: bool) -> int:
        """Reads the expansion at text[j] == "$" into `word`; returns the index after it."""
        nxt = text[j + 1] if j + 1 < n else ""
        if nxt == "(":  # $(...) or $((...)): balanced, quotes respected
            depth, k, q = 0, j + 1, None
            while k < n:
                c = text[k]
                if q:
                    q = None if c == q else q
                elif c in "'\"":
                    q = c
                elif c == "(":
                    depth += 1
                elif c == ")":
                    depth -= 1
                    if depth == 0:
                        break
                k += 1
            word.parts.append(("cmd", text[j : k + 1], quoted))
            return k + 1
        if nxt == "{":
            k = text.index("}", j)
            inner = text[j + 2 : k]
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(\[[@*]\])?", inner)
            if m:
                word.parts.append(("var", m.group(1), quoted, bool(m.group(2))))
            else:  # ${x:-y}, ${#x}, ...: not evaluated
                word.parts.append(("cmd", text[j : k + 1], quoted))
            return k + 1
        m = NAME.match(text, j + 1)
        if m:
            word.parts.append(("var", m.group(0), quoted, False))
            return m.end()
        if nxt and (nxt.isdigit() or nxt in "@*#?$!-"):  # $0, $@, $? ...
            word.parts.append(("cmd", text[j : j + 2], quoted))
            return j + 2
        word.lit("$", quoted)
        return j + 1

    while i < n:
        c = text[i]
        if c == "\\":
            if i + 1 < n and text[i + 1] == "\n":  # continuation
                i += 2
                continue
            word = word or Word()
            word.lit(text[i + 1 : i + 2], True)
            i += 2
        elif c == "'":
            k = text.index("'", i + 1)
            word = word or Word()
            word.lit(text[i + 1 : k], True)
            i = k + 1
        elif c == '"':
            word = word or Word()
            word.lit("", True)  # "" is a word
            i += 1
            while text[i] != '"':
                if text[i] == "\\" and text[i + 1] in '$`"\\\n':
                    if text[i + 1] != "\n":
                        word.lit(text[i + 1], True)
                    i += 2
                elif text[i] == "$":
                    i = dollar(i, True)
                else:
                    word.lit(text[i], True)
                    i += 1
            i += 1
        elif c == "$":
            word = word or Word()
            i = dollar(i, False)
        elif c == "#" and word is None:
            while i < n and text[i] != "\n":
                i += 1
        elif c == "\n":
            end_word()
            out.append("\n")
            i += 1
        elif c in " \t":
            end_word()
            i += 1
        elif c in OPERATOR_CHARS:
            if c == "(" and word is not None and word.parts and _ends_with_eq(word):  # NAME=( starts an array
                out.append(word)
                word = None
                out.append("=(")
                i += 1
                continue
            end_word()
            k = i
            while k < n and text[k] in OPERATOR_CHARS:
                k += 1
            out.append(text[i:k])
            i = k
        else:
            word = word or Word()
            word.lit(c, False)
            i += 1
    end_word()
    return out


def _ends_with_eq(word: Word) -> bool:
    last = word.parts[-1]
    return last[0] == "lit" and not last[2] and last[1].endswith("=")


def raw(word: Word) -> str:
    return "".join(p[1] if p[0] != "var" else f"${{{p[1]}}}" for p in word.parts)


class Script:
    """Variables as the script assigns them, in order; `given` (--set) wins over the script's own value."""

    def __init__(self, given: dict[str, str]):
        self.given = given
        self.vars: dict[str, object] = {}
        self.deps: dict[str, list[str]] = {}  # the variables each assignment's value expanded
        self.used: list[str] = []  # variables the train_ppo_ray arguments expanded (directly or not), in order

    def value(self, name: str):
        if name in self.given:
            return self.given[name]
        return self.vars.get(name, Unknown(f"${name} (unset)"))

    def track(self, name: str) -> None:
        if name not in self.used:
            self.used.append(name)
            for dep in self.deps.get(name, []):
                self.track(dep)

    def expand(self, word: Word, track: bool = False, seen: list | None = None) -> list[str]:
        """Bash's expansion of one word: the fields it becomes (unquoted expansions are split on blanks).
        `seen` collects the variables expanded; `track` marks them (and what they were made of) as used."""
        fields: list[str] = [""]
        keep = False  # a quoted part keeps an empty word
        for part in word.parts:
            kind = part[0]
            if kind == "lit":
                fields[-1] += part[1]
                keep = keep or part[2]
                continue
            if kind == "cmd":
                raise NotComputed(part[1])
            name, quoted, is_array = part[1], part[2], part[3]
            value = self.value(name)
            if seen is not None:
                seen.append(name)
            if track:
                self.track(name)
            items = value if isinstance(value, list) else [value]
            for v in items:
                if isinstance(v, Unknown):
                    raise NotComputed(f"${{{name}}} = {v}")
            if quoted:
                keep = True
                if is_array:
                    if items:
                        fields[-1] += items[0]
                        fields.extend(items[1:])
                else:
                    fields[-1] += " ".join(items)
            else:
                pieces = " ".join(items).split()
                if pieces:
                    fields[-1] += pieces[0]
                    fields.extend(pieces[1:])
        if fields == [""] and not keep:
            return []
        return fields

    def assign(self, words: list[Word]) -> None:
        """`NAME=value` (words[0]) or `NAME=` `=(` values `)`; a value that cannot be computed is Unknown."""
        head = raw(words[0])
        name = head.split("=", 1)[0]
        seen: list[str] = []
        self.deps[name] = seen
        if len(words) > 1:  # array
            items: list = []
            for w in words[1:]:
                try:
                    items.extend(self.expand(w, seen=seen))
                except NotComputed as e:
                    items.append(Unknown(str(e)))
            self.vars[name] = items
            return
        rest = Word(words[0].parts[:])
        first = rest.parts[0]  # strip "NAME=" from the first literal
        rest.parts[0] = ("lit", first[1][len(name) + 1 :], first[2])
        try:
            self.vars[name] = "".join(self.expand(rest, seen=seen))
        except NotComputed as e:
            self.vars[name] = Unknown(str(e))


def is_assignment(word) -> bool:
    if not isinstance(word, Word) or not word.parts or word.parts[0][0] != "lit" or word.parts[0][2]:
        return False
    return bool(re.match(r"[A-Za-z_][A-Za-z0-9_]*=", word.parts[0][1]))


def commands(tokens: list) -> list[list[Word]]:
    """Simple commands (lists of words), split at operators; array assignments kept whole (newlines inside)."""
    out, cur, i = [], [], 0
    while i < len(tokens):
        t = tokens[i]
        if t == "=(":  # NAME=( ... ): up to the matching ")"
            j = i + 1
            while tokens[j] != ")":
                j += 1
            cur.extend(w for w in tokens[i + 1 : j] if isinstance(w, Word))
            cur.append("array")
            i = j + 1
            continue
        if isinstance(t, Word):
            cur.append(t)
        else:
            if cur:
                out.append(cur)
            cur = []
        i += 1
    if cur:
        out.append(cur)
    return out


def train_args(text: str, script: Script, found: list) -> None:
    """Reads `text` as a script: assignments into `script`, each train_ppo_ray command's arguments into `found`."""
    for cmd in commands(tokenize(text)):
        if cmd[-1] == "array":
            script.assign(cmd[:-1])
            continue
        if is_assignment(cmd[0]) and len(cmd) == 1:
            script.assign(cmd)
            continue
        for k, w in enumerate(cmd):
            if TARGET not in raw(w):
                continue
            if raw(w) == TARGET:
                args: list[str] = []
                for rest in cmd[k + 1 :]:
                    args.extend(script.expand(rest, track=True))
                found.append(args)
            else:  # bash -c "... train_ppo_ray ...": the string's own commands
                train_args("".join(script.expand(w)), script, found)
            break


def readme_blocks(text: str) -> list[tuple[int, str, int]]:
    """The ```bash blocks of a README: (line of the opening fence, text, placeholder lines dropped). A line that is
    only `...` (the README's "other training args") becomes a bare continuation, so the command goes on."""
    out, lines, start, dropped = [], None, 0, 0
    for number, line in enumerate(text.splitlines(), 1):
        fence = line.strip()
        if lines is None:
            if fence in ("```bash", "```sh", "```shell"):
                lines, start, dropped = [], number, 0
        elif fence.startswith("```"):
            out.append((start, "\n".join(lines) + "\n", dropped))
            lines = None
        elif re.fullmatch(r"\s*\.\.\.\s*(#.*)?", line):
            lines.append("\\")
            dropped += 1
        else:
            lines.append(line)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tag")
    p.add_argument("path")
    p.add_argument("--readme", type=int, help="the N-th train_ppo_ray command of a README (1-based)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a value the script computes")
    a = p.parse_args()
    given = dict(s.split("=", 1) for s in a.set)
    text = sys.stdin.read()
    script = Script(given)
    found: list[list[str]] = []
    where: list[str] = []  # README: the block each command came from
    try:
        if a.readme:
            for line, block, dropped in readme_blocks(text):
                before = len(found)
                train_args(block, script, found)
                note = "; its `...` line (other training args) dropped: a partial command" if dropped else ""
                where += [f"the train_ppo_ray command in the ```bash block at line {line}{note}"] * (
                    len(found) - before
                )
        else:
            train_args(text, script, found)
    except NotComputed as e:
        sys.exit(f"{a.path}: the train_ppo_ray arguments need {e}: give it with --set NAME=VALUE")
    index = (a.readme or 1) - 1
    if len(found) <= index or (not a.readme and len(found) != 1):
        sys.exit(f"{a.path}: {len(found)} train_ppo_ray command(s) found")
    what = []
    for name in script.used:
        v = script.value(name)
        kind = f"{name}[@] ({len(v)} words)" if isinstance(v, list) else f"{name}={v}"
        what.append(kind + (f" (--set; the script computes {script.vars.get(name, 'it')})" if name in given else ""))
    unused = [name for name in given if name not in script.used]
    if unused:
        sys.exit(f"{a.path}: --set {', '.join(unused)}: the train_ppo_ray arguments do not use it")
    if a.readme:
        what.insert(0, where[index])
    cmd = f"git show {a.tag}:{a.path} | python scripts/openrlhf_script_args.py {a.tag} {a.path}"
    cmd += "".join(f" --set {s}" for s in a.set) + (f" --readme {a.readme}" if a.readme else "")
    print(f"# {a.tag} {a.path}: {'; '.join(what) or 'no shell variables'} | {cmd}")
    print("\n".join(found[index]))


if __name__ == "__main__":
    main()
