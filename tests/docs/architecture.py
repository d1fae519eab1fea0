"""docs/ARCHITECTURE.md against the code: each src/ folder's "depends on" column must name
exactly the project folders its files #include, every folder must have a row, the layers
picture must draw includes only and reach what they reach, and every function the docs cite as
`name()` or `Type::name()` must exist in src/."""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parents[2]
src = root / "src"
folders = sorted(p.name for p in src.iterdir() if p.is_dir())
errors = []

# A table row may wrap over several lines: it runs from "| `folder/` |" to a line ending in "|".
rows = {}
text = (root / "docs" / "ARCHITECTURE.md").read_text()
for m in re.finditer(r"^\|\s*`([a-z_]+)/`\s*\|(.*?)\|([^|\n]*)\|\s*$", text, re.M | re.S):
    rows[m.group(1)] = m.group(3)

include = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/', re.M)
includes = {}  # folder -> the project folders its files include
for folder in folders:
    used = set()
    for f in (src / folder).rglob("*"):
        if f.suffix in (".h", ".cpp", ".cu", ".cuh"):
            used.update(include.findall(f.read_text(errors="replace")))
    used.discard(folder)
    includes[folder] = used & set(folders)
    if folder not in rows:
        errors.append(f"src/{folder}/ has no row in docs/ARCHITECTURE.md")
        continue
    column = rows[folder]
    words = set(re.findall(r"[a-z_]+", column))
    if "everything" in words:  # the top (cli/): any folder below it
        continue
    documented = words & set(folders)
    documented.discard(folder)
    if used != documented:
        errors.append(
            f"docs/ARCHITECTURE.md: {folder}/ depends on {sorted(used)} by its #includes, "
            f"the doc says {sorted(documented)} (missing: {sorted(used - documented)}, "
            f"stale: {sorted(documented - used)})")

# The layers picture (a mermaid flowchart of `a --> b` arrows): each arrow an include, and the
# arrows reach, folder by folder, what the includes reach.
def reach(graph, start):
    seen, todo = set(), [start]
    while todo:
        for b in graph.get(todo.pop(), ()):
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


picture = re.search(r"```mermaid\nflowchart TD\n(.*?)```", text, re.S)
if not picture:
    errors.append("docs/ARCHITECTURE.md has no layers picture (```mermaid flowchart TD)")
else:
    arrows = {}
    for a, b in re.findall(r"^\s*([a-z_]+) --> ([a-z_]+)\s*$", picture.group(1), re.M):
        arrows.setdefault(a, set()).add(b)
        if b not in includes.get(a, ()):
            errors.append(
                f"docs/ARCHITECTURE.md picture: {a} --> {b}, but {a}/ includes nothing of {b}/")
    for folder in folders:
        drawn, real = reach(arrows, folder), reach(includes, folder)
        if drawn != real:
            errors.append(
                f"docs/ARCHITECTURE.md picture: {folder}/ reaches {sorted(drawn)} by its arrows, "
                f"{sorted(real)} by its includes (missing: {sorted(real - drawn)}, stale: "
                f"{sorted(drawn - real)})")
for folder in rows:
    if folder not in folders:
        errors.append(f"docs/ARCHITECTURE.md has a row for {folder}/, which src/ does not have")

code = "\n".join(f.read_text(errors="replace") for f in src.rglob("*")
                 if f.suffix in (".h", ".cpp", ".cu", ".cuh"))
defined = set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", code))
docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
for doc in docs:
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for ref in re.findall(r"`((?:[A-Za-z_]\w*::)*[A-Za-z_]\w*)\(\)`", line):
            name = ref.split("::")[-1]
            if name not in defined:
                errors.append(f"{doc.relative_to(root)}:{n}: `{ref}()` is not a function in src/")

for e in errors:
    print(e)
print(f"architecture: {len(folders)} folders, {len(docs)} docs checked, {len(errors)} problems")
sys.exit(1 if errors else 0)
