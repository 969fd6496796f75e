#!/usr/bin/env python3
"""Fails when the modules of a Rust crate import each other in a circle, file by file or
top-level module by top-level module.

Usage: module-cycles.py ROOT_FILE [ROOT_FILE ...]   (e.g. src/lib.rs)

A file is a module (`a/b.rs` or `a/b/mod.rs` is `crate::a::b`). File A depends on file B
when A names an item that B defines: through `use crate::…`, `super::…`, `self::…`, a
child module's name, a name it imported, or a path written inline. A path is followed
through `pub use` re-exports to the file that defines the item, and depends on that file
and on every file whose re-export it passes through: `crate::fleet::Node` depends on the
file that declares `Node` and on `fleet/mod.rs`, which must be read to resolve the name.
Declaring a child module (`mod x;`) is not a dependency. Comments and string literals are
ignored.

Two graphs must have no cycle (no strongly connected component of more than one node):
the files' dependencies, and the same dependencies between rooms, each file collapsed to
its top-level module (`crate::fleet::prober` is in `fleet`, `crate::metrics` in
`metrics`, the crate root file alone in `crate`), so that no module imports from one that
depends on it ("no arrow up"). Each cycle found is printed with the file-level edges that
make it, one per line with where it comes from; among rooms, an import's edge to a file
that re-exports the item is left out when its edge to the defining file is in that room.
"""

import os
import re
import sys

ITEM = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:(?:async|const|unsafe|extern\s+\"[^\"]*\")\s+)*"
    r"(?:fn|struct|enum|trait|type|const|static|union|mod|macro_rules!)\s+([A-Za-z_][A-Za-z0-9_]*)",
    re.M,
)
USE = re.compile(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]*);", re.S)
PATH = re.compile(r"(?<![A-Za-z0-9_:])([A-Za-z_][A-Za-z0-9_]*(?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+)")


def strip(source):
    """The source with comments, string and char literals blanked (newlines kept)."""
    out, i, n = [], 0, len(source)
    while i < n:
        c = source[i]
        if source.startswith("//", i):
            j = source.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif source.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if source.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif source.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * source.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', source[i:]) and (i == 0 or not (source[i - 1].isalnum() or source[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", source[i:]).group(1)
            end = source.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append('""' + "\n" * source.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and source[j] != '"':
                j += 2 if source[j] == "\\" else 1
            out.append('""' + "\n" * source.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.[^']*|[^\\'])'", source[i:]):
            m = re.match(r"'(\\.[^']*|[^\\'])'", source[i:])
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use_tree(tree):
    """`a::{b, c::{d, e as f}, self}` -> ['a::b', 'a::c::d', 'a::c::e', 'a']."""
    tree = re.sub(r"\s+", "", tree)

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            parts.append(cur)
        return parts

    def walk(prefix, s):
        i = s.find("{")
        if i < 0:
            s = s.split("as")[0] if re.search(r"[a-z0-9_]as[A-Za-z_]", s) is None else re.sub(r"(?<=[A-Za-z0-9_])as[A-Za-z_][A-Za-z0-9_]*$", "", s)
            full = prefix + s
            if full.endswith("::self"):
                full = full[: -len("::self")]
            return [full] if full else []
        head, body = s[:i], s[i + 1 : s.rfind("}")]
        result = []
        for part in split_top(body):
            result += walk(prefix + head, part)
        return result

    return [p.rstrip(":") for p in walk("", tree)]


class Crate:
    def __init__(self, root_file):
        self.root_file = root_file
        self.root_dir = os.path.dirname(root_file)
        self.files = {}  # module path tuple -> file
        self.items = {}  # file -> set of item names
        self.reexports = {}  # file -> {name: path}
        self.text = {}
        self.load((), root_file)

    def child_file(self, file, name):
        base = os.path.dirname(file)
        if not (file == self.root_file or os.path.basename(file) == "mod.rs"):
            base = os.path.join(base, os.path.splitext(os.path.basename(file))[0])
        for candidate in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
            if os.path.exists(candidate):
                return candidate
        return None

    def load(self, module, file):
        self.files[module] = file
        text = strip(open(file, encoding="utf-8").read())
        self.text[file] = text
        self.items[file] = set(ITEM.findall(text))
        self.reexports[file] = {}
        children = re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;", text, re.M)
        for m in USE.finditer(text):
            if m.group(1):
                for path in expand_use_tree(m.group(2)):
                    head = path.split("::")[0]
                    if head in children:
                        path = "self::" + path
                    elif head not in ("crate", "super", "self"):
                        continue  # another crate's item
                    self.reexports[file][path.split("::")[-1]] = path
        for name in children:
            child = self.child_file(file, name)
            if child:
                self.load(module + (name,), child)

    def module_of(self, file):
        return next(m for m, f in self.files.items() if f == file)

    def inline_depth(self, file, position):
        """How many inline `mod x { … }` blocks of `file` enclose `position`."""
        text, depth = self.text[file], 0
        for m in re.finditer(r"\bmod\s+[A-Za-z_][A-Za-z0-9_]*\s*\{", text):
            if m.start() > position:
                break
            level, j = 1, m.end()
            while j < len(text) and level:
                level += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            if position < j:
                depth += 1
        return depth

    def resolve(self, file, path, seen=None, position=None):
        """The files `path` (written in `file`) depends on: the one defining what it names,
        then each whose `pub use` re-export it passes through; [] if outside the crate."""
        seen = seen or set()
        if (file, path) in seen:
            return []
        seen.add((file, path))
        parts = [p for p in re.split(r"\s*::\s*", path) if p]
        module = list(self.module_of(file))
        if parts[0] == "crate":
            module, parts = [], parts[1:]
        elif parts[0] in ("super", "self"):
            # Inside an inline module (`mod tests { use super::*; }`) the first `super`s
            # only climb back to the file's own module.
            inline = self.inline_depth(file, position) if position is not None else 0
            while parts and parts[0] in ("super", "self"):
                if parts[0] == "super":
                    if inline:
                        inline -= 1
                    elif module:
                        module.pop()
                parts = parts[1:]
        else:
            return []
        while parts and tuple(module + [parts[0]]) in self.files:
            module.append(parts.pop(0))
        target = self.files[tuple(module)]
        if parts and parts[0] in self.reexports[target]:
            found = self.resolve(target, self.reexports[target][parts[0]], seen)
            return found + [target] if found else [target]
        return [target]

    def edges(self):
        graph = {f: {} for f in self.files.values()}
        for file, text in self.text.items():
            paths = []
            for m in USE.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                paths += [(p, line, m.start()) for p in expand_use_tree(m.group(2))]
            for m in PATH.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                paths.append((m.group(1), line, m.start()))
            module = self.module_of(file)
            # Names this file brings into scope: its child modules and what it `use`s.
            local = {m[-1]: "self::" + m[-1] for m in self.files if m[:-1] == module and m}
            for p, _, _ in paths:
                if re.match(r"(crate|super|self)\b", p) and not p.endswith("*"):
                    local.setdefault(p.split("::")[-1], p)
            for path, line, position in paths:
                head = re.split(r"\s*::\s*", path)[0]
                if head not in ("crate", "super", "self"):
                    if head not in local or local[head] == path:
                        continue
                    path = local[head] + path[len(head):]
                found = self.resolve(file, path, position=position)
                for i, target in enumerate(found):
                    if target != file:
                        graph[file].setdefault(target, (line, re.sub(r"\s+", "", path), i > 0))
        return graph

    def room(self, file):
        """The top-level module `file` belongs to (`crate::fleet::prober` -> `fleet`); the
        crate root file is a room of its own, `crate`."""
        module = self.module_of(file)
        return module[0] if module else "crate"


def cycles(graph):
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def report(root, kind, graph, room=None):
    """Prints the cycles of `graph` among `kind` (its files, or their rooms when `room`
    maps a file to one) with the file-level edges that make each; True if there is one.
    Among rooms, an import's edge to a file that re-exports the item is left out when
    its edge to the defining file is in the same room."""
    group = room or (lambda f: f)
    collapsed = {}
    for f, targets in graph.items():
        collapsed.setdefault(group(f), set()).update(map(group, targets))
        collapsed[group(f)].discard(group(f))
    found = cycles(collapsed)
    if not found:
        edges = sum(len(v) for v in collapsed.values())
        print(f"{root}: {len(collapsed)} {kind}, {edges} dependencies, no cycle")
        return False
    for component in found:
        names = f" ({', '.join(component)})" if room else ""
        print(f"{root}: a cycle of {len(component)} {kind}{names}:")
        members = set(component)
        for f in sorted(graph):
            if group(f) not in members:
                continue
            defined = {(group(g), line, path) for g, (line, path, via) in graph[f].items()
                       if not via}
            for g, (line, path, via) in sorted(graph[f].items()):
                if group(g) == group(f) or group(g) not in members:
                    continue
                if via and room and (group(g), line, path) in defined:
                    continue
                print(f"  {f}:{line} -> {g}  ({path}{', re-exported there' if via else ''})")
    return True


def main():
    failed = False
    for root in sys.argv[1:]:
        crate = Crate(root)
        graph = crate.edges()
        failed |= report(root, "modules", graph)
        failed |= report(root, "top-level modules", graph, crate.room)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
