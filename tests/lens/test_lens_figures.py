"""Lens figures: shapes are checked, PNGs are written, NaN cells stay blank."""

import numpy as np
import pytest

from mdm_lens.views.fig_lens import emergence_map, lens_heatmap


def test_heatmap_and_emergence_map(tmp_path):
    grid = np.array([[0.1, 0.5, np.nan], [0.9, 1.0, np.nan]])
    fig = lens_heatmap(grid, [0, 1, 2], [0, 1], path=tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 0
    img = fig.axes[0].images[0].get_array()
    assert img.mask.tolist() == [[False, False, True], [False, False, True]]       # NaN = undefined, shown grey
    first = np.array([[np.nan, 1.0], [0.0, 1.0]])
    fig = emergence_map(first, np.array([2, 1]), [0, 3], labels=["a", "b"], path=tmp_path / "e.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a\nc2", "b\nc1"]
    assert [t.get_text() for t in ax.texts] == ["–"]                             # the one 'never' cell
    assert len(ax.lines) == 1                                                    # emerged before commit: (1, 0)
    with pytest.raises(ValueError):
        lens_heatmap(grid, [0, 1], [0, 1])
    with pytest.raises(ValueError):
        emergence_map(first, np.array([2, 1, 0]), [0, 3])
