"""The demo model's scene generators (training/data.py's varied scenes, training/second_scenes.py):
names stay right, shapes stay in their cells, and the second generator's rasteriser draws the areas
geometry says (checked against the shoelace / circle area, on random shapes)."""

from __future__ import annotations

import colorsys
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

import data  # noqa: E402
import second_scenes  # noqa: E402


def in_region(name: str, rgb: tuple[int, int, int], slack: float = 0.0) -> bool:
    """``rgb`` lies in ``data.COLOUR_REGIONS[name]`` (``slack``: how far outside, hue in degrees / 30)."""
    h0, h1, s0, s1, v0, v1 = data.COLOUR_REGIONS[name]
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    hue = h * 360
    if hue > h1 + 30 * slack:
        hue -= 360
    return h0 - 30 * slack <= hue <= h1 + 30 * slack and s0 - slack <= s <= s1 + slack and v0 - slack <= v <= v1 + slack


def test_colour_regions_do_not_meet():
    rng = np.random.default_rng(1)
    for name in data.COLOUR_REGIONS:
        for _ in range(300):
            rgb = data.varied_colour(name, rng)
            assert in_region(name, rgb, slack=0.03), (name, rgb)  # slack: rounding to 0-255
            others = [o for o in data.COLOUR_REGIONS if o != name and in_region(o, rgb)]
            assert not others, (name, rgb, others)


@pytest.mark.parametrize("name", list(data.COLOURS))
def test_named_colours_lie_in_their_regions(name):
    assert in_region(name, data.COLOURS[name])
    for rgb in second_scenes.PALETTE[name]:
        assert in_region(name, rgb), (name, rgb)
        assert [o for o in data.COLOUR_REGIONS if in_region(o, rgb)] == [name]


@pytest.mark.parametrize("make", [data.varied_scene, second_scenes.scene])
def test_shapes_fit_their_cells(make):
    for seed in range(200):
        sc = make(seed)
        h, w = sc.size
        assert 1 <= len(sc.shapes) <= 5 and len({s.cell for s in sc.shapes}) == len(sc.shapes)
        for sh in sc.shapes:
            assert sh.cell == min(int(sh.y * 3), 2) * 3 + min(int(sh.x * 3), 2)
            assert sc.background not in data.CLASHES.get(sh.colour, ())
        assert set(data.questions(sc)) <= set(data.QUESTION_TYPES)


def test_position_is_asked_only_about_a_unique_object():
    seen = 0
    for seed in range(400):
        sc = data.varied_scene(seed)
        qs = data.questions(sc)
        if "position" in qs:
            colour, kind = qs["position"][1].split()[1:3]
            assert sum((s.colour, s.kind) == (colour, kind) for s in sc.shapes) == 1
        seen += len({(s.colour, s.kind) for s in sc.shapes}) < len(sc.shapes)
    assert seen > 40  # repeated pairs occur (about 1 scene in 4 of 2+ shapes)


def test_varied_render_is_deterministic_and_sized():
    for seed in range(12):
        sc = data.varied_scene(seed)
        a, b = data.render_varied(sc), data.render_varied(sc)
        assert a.size == (sc.size[1], sc.size[0]) and np.array_equal(np.asarray(a), np.asarray(b))


def shoelace(poly: np.ndarray) -> float:
    x, y = poly[:, 0], poly[:, 1]
    return 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))


@pytest.mark.parametrize("kind", data.SHAPES)
def test_rasterised_area_matches_geometry(kind):
    """Coverage summed over the pixels equals the shape's area: a circle pi r^2, a polygon its shoelace
    area. With 4x4 samples per pixel the error is boundary pixels x 1/16 at most: below 2 % here."""
    rng = np.random.default_rng(list(data.SHAPES).index(kind))
    for _ in range(4):
        r = rng.uniform(20, 45)
        c = (rng.uniform(50, 70), rng.uniform(50, 70))
        angle, stretch = rng.uniform(-0.3, 0.3), rng.uniform(0.4, 0.75)
        poly = second_scenes._outline(kind, c[0], c[1], r, angle, stretch)
        want = math.pi * r * r if kind == "circle" else shoelace(poly)
        subs = (np.arange(120 * 4) + 0.5) / 4
        py, px = np.meshgrid(subs, subs, indexing="ij")
        got = second_scenes._inside(kind, px, py, c, r, poly).sum() / 16
        assert abs(got - want) / want < 0.02, (kind, got, want)


def test_second_render_fills_with_the_named_colour():
    """The pixel under each shape's centre has the shape's colour name (up to the palette's jitter,
    noise and JPEG: the slack), on 40 scenes without strong noise."""
    checked = 0
    for seed in range(60):
        sc = second_scenes.scene(seed)
        if sc.noisy:
            continue
        img = np.asarray(second_scenes.render(sc))
        for sh in sc.shapes:
            centre = img[int(sh.y * sc.size[0]), int(sh.x * sc.size[1])]
            assert in_region(sh.colour, tuple(int(v) for v in centre), slack=0.12), (seed, sh, centre)
        checked += 1
    assert checked >= 40


def answer_kind(enc: data.Encoder, smp: data.Sample) -> str:
    """The question type of an image sample, read back from its answer sentence (:func:`data.questions`)."""
    answer = enc.tok.decode([int(t) for t in smp.labels if t != -100])
    if answer.startswith("There "):
        return "count"
    if answer.startswith("I see "):
        return "describe"
    if " shape is a" in answer:
        return "shape"
    return "position" if any(f" is {p.split()[0]} the " in answer for p in data.POSITIONS) else "colour"


def test_question_weights_shift_the_question_types():
    """``training_sample`` without weights picks uniformly among the scene's question types (2-5 of them,
    most scenes all 5): shape about 1 in 5. With ``{"shape": 3}`` a scene with all five asks shape with
    probability 3 / 7 = 0.43 (0.39 over these indices: some scenes have no shape question), with
    ``{"shape": 1e6}`` whenever the scene has a shape question (most do). The bounds are about 3
    standard deviations wide for the ~140 image samples of 150 indices (the samples are a pure
    function of the index, so the test is deterministic)."""
    enc = data.Encoder(data.load_vocab())
    share = {}
    for name, weights in [("uniform", None), ("shape=3", {"shape": 3.0}), ("shape only", {"shape": 1e6})]:
        kinds = [answer_kind(enc, smp) for i in range(150)
                 if (smp := data.training_sample(enc, 40_000 + i, weights)).pixel_values is not None]
        assert len(kinds) > 120 and set(kinds) <= set(data.QUESTION_TYPES)
        share[name] = kinds.count("shape") / len(kinds)
    assert 0.1 < share["uniform"] < 0.32, share
    assert 0.28 < share["shape=3"] < 0.55, share
    assert share["shape only"] > 0.9, share
