"""The overview's world map: Natural Earth land (the `world-atlas` package's TopoJSON,
vendored under static/vendor) drawn as one SVG path in an equirectangular projection,
with clusters placed by their latitude and longitude. Rendered on the server, so the map
needs no script and every marker is a labelled SVG element."""

from __future__ import annotations

import functools
import itertools
import json
from importlib import resources

WIDTH = 960.0
LAT_TOP, LAT_BOTTOM = 84.0, -58.0  # Antarctica and the Arctic ocean are cut off
HEIGHT = round(WIDTH * (LAT_TOP - LAT_BOTTOM) / 360.0, 1)


def project(lat: float, lon: float) -> tuple[float, float]:
    """(lat, lon) in degrees -> (x, y) in the map's SVG coordinates."""
    x = (lon + 180.0) / 360.0 * WIDTH
    y = (LAT_TOP - lat) / (LAT_TOP - LAT_BOTTOM) * HEIGHT
    return round(x, 1), round(y, 1)


def _arcs(topology: dict) -> list[list[tuple[float, float]]]:
    """Decoded arcs in (lon, lat): quantized, delta-encoded positions per the TopoJSON spec."""
    transform = topology.get("transform")
    out = []
    for arc in topology["arcs"]:
        x = y = 0
        points = []
        for dx, dy, *_ in arc:
            if transform:
                x, y = x + dx, y + dy
                (sx, sy), (tx, ty) = transform["scale"], transform["translate"]
                points.append((x * sx + tx, y * sy + ty))
            else:
                points.append((dx, dy))
        out.append(points)
    return out


def _ring(arcs: list[list[tuple[float, float]]], indexes: list[int]) -> list[tuple[float, float]]:
    points: list[tuple[float, float]] = []
    for index in indexes:
        arc = arcs[index] if index >= 0 else arcs[~index][::-1]
        points.extend(arc if not points else arc[1:])
    return points


def _polygons(geometry: dict) -> list[list[list[int]]]:
    kind = geometry.get("type")
    if kind == "Polygon":
        return [geometry["arcs"]]
    if kind == "MultiPolygon":
        return list(geometry["arcs"])
    if kind == "GeometryCollection":
        return [p for g in geometry.get("geometries", []) for p in _polygons(g)]
    return []


def svg_path(topology: dict, name: str) -> str:
    """An SVG path `d` of every polygon of object `name` (draw with fill-rule evenodd)."""
    arcs = _arcs(topology)
    parts = []
    for polygon in _polygons(topology["objects"][name]):
        for ring in polygon:
            points = [project(lat, lon) for lon, lat in _ring(arcs, ring)]
            if len(points) < 3:
                continue
            path = [f"M{points[0][0]} {points[0][1]}"]
            for (x0, _), (x, y) in itertools.pairwise(points):
                # a ring that crosses the antimeridian jumps across the map: move, don't draw
                path.append(f"{'M' if abs(x - x0) > WIDTH / 2 else 'L'}{x} {y}")
            parts.append("".join(path) + "Z")
    return "".join(parts)


@functools.cache
def land_path() -> str:
    text = resources.files("control_plane.console").joinpath("static/vendor/land-110m.json").read_text()
    return svg_path(json.loads(text), "land")


@functools.cache
def land_svg() -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}">'
        f'<path d="{land_path()}" fill="#c7cfd9" stroke="#aab4c0" stroke-width="0.5" fill-rule="evenodd"/></svg>'
    )
