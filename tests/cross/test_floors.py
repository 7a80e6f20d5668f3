"""The rooms (packages and top-level modules of pipefill) stand on floors: a room imports only
rooms on lower floors, at module level and inside functions alike, so there is no import cycle
and the ground floor (pipefill.base) imports nothing of pipefill."""
import ast
from pathlib import Path

import pipefill

FLOORS = [
    {"base"},                   # platform facts and data contracts
    {"config", "kernels"},
    {"comm"},                   # collectives inside a stage (tensor parallelism)
    {"model"},
    {"kv", "chunking"},
    {"scheduler", "planner"},   # planner: layouts over the chunking room's simulator
    {"disagg"},
    {"runtime"},
    {"frontend"},
    {"engine"},
    {"server"},
    {"bench"},
    {"cli"},
    {"__init__"},               # the package's public names
]
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
ROOT = Path(pipefill.__file__).parent


def room_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def pipefill_imports(tree: ast.AST):
    """(line, imported room) for every import of pipefill.X anywhere in the module."""
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "pipefill":
                names = [f"pipefill.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "pipefill" and len(parts) > 1:
                yield node.lineno, parts[1]


def test_every_room_has_a_floor():
    rooms = {room_of(p) for p in ROOT.rglob("*.py")}
    assert rooms <= set(FLOOR), f"rooms without a floor: {sorted(rooms - set(FLOOR))}"


def test_no_room_imports_its_own_floor_or_above():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        src = room_of(path)
        for line, dst in pipefill_imports(ast.parse(path.read_text())):
            if dst != src and FLOOR.get(dst, len(FLOORS)) >= FLOOR[src]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} {src} -> {dst}")
    assert not upward, "imports that are not downward:\n" + "\n".join(upward)


def room_graph() -> dict[str, set[str]]:
    """room -> the rooms it imports (inside functions too)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        src = room_of(path)
        targets = graph.setdefault(src, set())
        targets |= {dst for _, dst in pipefill_imports(ast.parse(path.read_text())) if dst != src}
    return graph


if __name__ == "__main__":  # `python tests/cross/test_floors.py`: the room graph, by floor
    graph = room_graph()
    for room in sorted(graph, key=lambda r: (FLOOR.get(r, len(FLOORS)), r)):
        print(f"{FLOOR.get(room, '?')!s:>2} {room:10s} -> {', '.join(sorted(graph[room])) or '-'}")
