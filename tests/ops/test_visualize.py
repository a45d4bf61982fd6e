"""es.visualize: which ranks hold which block."""

import io

import pytest

import einshard as es


def test_blocks_and_ranks_of_an_uneven_split():
    buf = io.StringIO()
    text = es.visualize("a/tp b", (10, 4), mesh=es.Mesh.virtual((4,), ("tp",)), file=buf)
    assert buf.getvalue().strip() == text
    assert "a[0:3] b[:]" in text and "a[9:10] b[:]" in text


def test_replicas_are_grouped_and_partial_is_said():
    text = es.visualize("a/dp b/tp // sp", (10, 6), mesh=es.Mesh.virtual((2, 2, 2), ("dp", "sp", "tp")), file=io.StringIO())
    assert "partial over sp" in text
    assert "ranks 0,2  a[0:5] b[0:3]" in text
    assert "ranks 5,7  a[5:10] b[3:6]" in text


def test_shapes_and_compound_dimensions():
    text = es.visualize(
        "a/dp-tp b", (10, 6), mesh=es.Mesh.virtual((2, 4), ("dp", "tp")), shapes={"dp-tp": [1] * 7 + [3]},
        file=io.StringIO(),
    )
    assert "rank 7  a[7:10] b[:]" in text


def test_a_formula_is_rejected():
    with pytest.raises(ValueError, match="one tensor spec"):
        es.visualize("a/tp -> a", (4,), mesh=es.Mesh.virtual((4,), ("tp",)))
