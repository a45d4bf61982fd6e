"""Local einshard in five steps, each checked against plain torch.

Run: ``python examples/local_einshard.py`` (under a second; ``--device cpu`` or ``cuda``: the default, ``auto``,
is a GPU where there is one).
"""

import torch

import einshard as es
from einshard.testing import local_device, parse_device


def main(argv=None) -> None:
    with torch.device(local_device(parse_device(argv, __doc__.splitlines()[0]))):  # every tensor below: there
        steps()


def steps() -> None:
    torch.manual_seed(0)

    # 1. a linear layer: contraction over c
    x, w = torch.randn(8, 16), torch.randn(32, 16)
    y = es.einshard("batch c, hidden c -> batch hidden", x, w)
    torch.testing.assert_close(y, x @ w.T)

    # 2. attention scores with heads factored out of the feature axis
    q, k = torch.randn(2, 10, 64), torch.randn(2, 12, 64)
    scores = es.einshard("b n (h d), b m (h d) -> b h n m", q, k, sizes={"h": 8})
    torch.testing.assert_close(scores, q.view(2, 10, 8, 8).transpose(1, 2) @ k.view(2, 12, 8, 8).permute(0, 2, 3, 1))

    # 3. merge the heads back: a permutation and a factored output axis
    heads = es.einshard("b n (h d) -> b h n d", q, sizes={"h": 8})
    torch.testing.assert_close(es.einshard("b h n d -> b n (h d)", heads), q)

    # 4. window partition with families: (h kh) (w kw) -> h w kh kw
    image = torch.randn(2, 8, 12, 3)
    families = {"space": ("h", "w"), "win": ("kh", "kw")}
    windows = es.einshard("b [*space *win] c -> b *space *win c", image, families=families, sizes={"win": (2, 3)})
    torch.testing.assert_close(windows, image.view(2, 4, 2, 4, 3, 3).permute(0, 1, 3, 2, 4, 5))

    # 5. gradients flow like torch.einsum's
    a = torch.randn(3, 4, requires_grad=True)
    es.einshard("i j, i j ->", a, a).backward()
    torch.testing.assert_close(a.grad, 2 * a.detach())

    # 6. malformed formulas say where they went wrong: this error is deliberate
    print("A deliberate error (an unclosed '('), to show how einshard reports one:")
    try:
        es.einshard("b (n -> b n", q)
    except ValueError as err:
        print(err)
    # the last line: every check above passed; the shape is that of the window partition in step 4
    # (batch 2, 4 x 4 windows of 2 x 3 pixels, 3 channels)
    print("local einshard example: ok, windows of shape", tuple(windows.shape))


if __name__ == "__main__":
    main()
