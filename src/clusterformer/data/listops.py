"""ListOps (Nangia & Bowman 2018) as the Long Range Arena uses it: nested lists of operations on digits, ten classes.

An expression is a tree whose inner nodes are operators over 2..``max_args`` arguments and whose leaves are digits:

    [MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]   ->   5

with ``MAX``, ``MIN``, ``MED`` (the median, rounded down to an integer as LRA's ``int(np.median(...))`` does) and
``SM`` (the sum modulo 10). The label is the value of the root, a digit. Following the LRA generator's rules: a node
below the root is an operator with probability ``operator_p`` (0.25) while its depth is below ``max_depth`` (10),
otherwise a digit; the root is always an operator; operators and digits are drawn uniformly; trees are drawn until
their token count lies in [``min_length``, ``max_length``] (LRA: 500 to 2,000). Tokens are whitespace separated,
each operator opens with its ``[NAME`` token and closes with ``]`` (LRA's extra parentheses are left out: they carry
no information).

Generation is seeded (``random.Random(seed)``, never the global RNG), so a seed gives the same data set on every
machine; a test checks every label against an independent evaluator (:func:`evaluate_listops`).
"""

from __future__ import annotations

import random
import statistics

import torch

from .._checks import check_float, check_int

__all__ = ["LISTOPS_VOCAB", "encode_listops", "evaluate_listops", "generate_listops"]

OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
LISTOPS_VOCAB = ("<pad>", *OPERATORS, "]", *(str(d) for d in range(10)))  # id 0 is padding


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int, operator_p: float) -> list | str:
    if depth > 0 and (depth >= max_depth or rng.random() >= operator_p):
        return str(rng.randrange(10))
    children = [_tree(rng, depth + 1, max_depth, max_args, operator_p) for _ in range(rng.randint(2, max_args))]
    return [rng.choice(OPERATORS), *children]


def _tokens(tree: list | str, out: list[str]) -> list[str]:
    if isinstance(tree, str):
        out.append(tree)
        return out
    out.append(tree[0])
    for child in tree[1:]:
        _tokens(child, out)
    out.append("]")
    return out


def _apply(operator: str, values: list[int]) -> int:
    if operator == "[MAX":
        return max(values)
    if operator == "[MIN":
        return min(values)
    if operator == "[MED":
        return int(statistics.median(values))  # LRA: int(np.median(values)), rounding a half down
    return sum(values) % 10  # [SM


_EVALUATE = {  # on sorted arguments; kept apart from _apply on purpose (the tests compare the two)
    "[MAX": lambda v: v[-1],
    "[MIN": lambda v: v[0],
    "[MED": lambda v: (v[(len(v) - 1) // 2] + v[len(v) // 2]) // 2,
    "[SM": lambda v: sum(v) % 10,
}


def evaluate_listops(expression: str) -> int:
    """The value of a ListOps expression (whitespace-separated tokens), by a stack machine -- written apart from
    the generator so that the tests can check the generator's labels against it. ``ValueError`` if malformed."""
    stack: list[tuple[str, list[int]]] = []
    result = None
    for token in expression.split():
        if token in OPERATORS:
            stack.append((token, []))
        elif token == "]":
            if not stack:
                raise ValueError(f"unbalanced ']' in {expression[:60]!r}")
            operator, values = stack.pop()
            if not values:
                raise ValueError(f"operator {operator} without arguments")
            value = _EVALUATE[operator](sorted(values))
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        elif token.isdigit() and len(token) == 1:
            if not stack:
                raise ValueError("a digit outside every operator")
            stack[-1][1].append(int(token))
        else:
            raise ValueError(f"unknown ListOps token {token!r}")
    if stack or result is None:
        raise ValueError(f"unterminated ListOps expression {expression[:60]!r}")
    return result


def _value(tree: list | str) -> int:
    if isinstance(tree, str):
        return int(tree)
    return _apply(tree[0], [_value(child) for child in tree[1:]])


def generate_listops(
    n: int, *, seed: int, min_length: int = 500, max_length: int = 2000, max_depth: int = 10, max_args: int = 10,
    operator_p: float = 0.25,
) -> tuple[list[str], list[int]]:
    """``n`` expressions (token strings) and their labels (digits), drawn as the module docs say."""
    check_int("n", n, minimum=0)
    check_int("min_length", min_length, minimum=3)
    check_int("max_length", max_length, minimum=min_length)
    check_int("max_depth", max_depth, minimum=1)
    check_int("max_args", max_args, minimum=2)
    check_float("operator_p", operator_p, minimum=0.0, maximum=1.0, exclusive_minimum=True)
    rng = random.Random(seed)
    texts, labels = [], []
    while len(texts) < n:  # rejection by length, as LRA does (about 3 draws per kept tree at 500..2000)
        tree = _tree(rng, 0, max_depth, max_args, operator_p)
        tokens = _tokens(tree, [])
        if min_length <= len(tokens) <= max_length:
            texts.append(" ".join(tokens))
            labels.append(_value(tree))
    return texts, labels


def encode_listops(texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (n, L) over :data:`LISTOPS_VOCAB` and the padding mask (n, L), L = the longest (<= max_len).
    ``ValueError`` if an expression is longer than ``max_len`` (cutting one would change its value)."""
    index = {token: i for i, token in enumerate(LISTOPS_VOCAB)}
    rows = [[index[t] for t in text.split()] for text in texts]
    longest = max((len(r) for r in rows), default=1)
    if longest > max_len:
        raise ValueError(f"a ListOps expression has {longest} tokens, more than max_len={max_len}")
    ids = torch.zeros(len(rows), max(longest, 1), dtype=torch.long)
    for i, row in enumerate(rows):  # once per data set, not a hot path
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return ids, ids == 0
