"""Generate the built-in training corpus, `megatron_dsa/corpus/<name>.txt.gz`.

    python tools/make_corpus.py           # check that the shipped file is what this script makes
    python tools/make_corpus.py --write   # (re)write it, then pin the printed SHA-256 in data.py

The text is written by this script alone (a small grammar of English-like prose about travellers,
towns and trades, with numbers), so it is free to redistribute with the package. It contains only
printable ASCII without `=`, `;` and `?`, which the retrieval task uses as delimiters. The shipped
file, not this script, is the corpus: `megatron_dsa.data.load_builtin_corpus` checks its SHA-256,
so a change here must come with a new corpus version.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron_dsa.data import BUILTIN_CORPUS, BUILTIN_CORPUS_SHA256, CORPUS_DIR  # noqa: E402

SEED = 20240601
TARGET_BYTES = 3_000_000

NAMES = ("Ada Bram Cora Dov Edda Finn Greta Hal Ines Joss Kara Lev Mira Nils Olga Pavel Quinn Rosa "
         "Sven Tova Ugo Vera Wim Xena Yuri Zora Anton Bea Cyril Dana Emil Faye Gus Hedda Ivo Juno").split()
TOWNS = ("Ashford Brill Caddon Dunmere Eskholt Farrow Glenby Harlow Ivywick Jarrow Kelmsey Lindal "
         "Marrow Northby Oakhurst Penrith Quarry Rookham Saltmarsh Thornby Upwell Vane Westerby Yarrow").split()
TRADES = ("baker smith weaver miller carter potter mason cooper tanner fisher chandler glazier "
          "joiner thatcher brewer dyer").split()
GOODS = ("bread nails cloth flour barrels pots stones casks hides fish candles glass chairs reeds "
         "ale dye apples salt wool rope lamps maps seeds honey").split()
ANIMALS = "horse dog goose cat ox mule crow heron fox hare owl".split()
PLACES = ("market mill bridge harbour chapel inn square forge orchard granary gate ford wharf meadow "
          "ridge").split()
ADJECTIVES = ("old quiet busy narrow cold bright wet dusty long crooked green grey steep small broad "
              "windy muddy lively sleepy famous").split()
WEATHER = ("rain fell all morning", "the wind came off the sea", "fog lay over the fields",
           "the sun was warm on the stones", "snow had closed the high road", "the river ran high")
TIMES = ("At dawn", "Before noon", "In the evening", "Late at night", "On market day", "In spring",
         "By the end of the week", "After the harvest", "In winter", "Every morning")
VERBS = (("sold", "sold"), ("carried", "carried"), ("brought", "brought"), ("sent", "sent"), ("gave", "given"),
         ("showed", "shown"), ("lent", "lent"), ("promised", "promised"))  # past tense, past participle
FEELINGS = ("pleased", "tired", "worried", "proud", "surprised", "hungry", "cheerful", "restless")
NUMBER_WORDS = ("two three four five six seven eight nine ten eleven twelve twenty forty "
                "a hundred").split(" ")


def _place(rng: random.Random) -> str:
    return "the " + rng.choice(PLACES)


def sentence(rng: random.Random) -> str:
    """One sentence from one of a dozen templates."""
    a, b = rng.sample(NAMES, 2)
    town, other = rng.sample(TOWNS, 2)
    trade, good, adjective = rng.choice(TRADES), rng.choice(GOODS), rng.choice(ADJECTIVES)
    verb, participle = rng.choice(VERBS)
    count = rng.randint(2, 99)
    kind = rng.randrange(12)
    if kind == 0:
        return f"{a} the {trade} {verb} {count} {good} to {b} at {_place(rng)}."
    if kind == 1:
        return f"{rng.choice(TIMES)}, {a} walked from {town} to {other}, a road of {count} miles."
    if kind == 2:
        return f"The {adjective} {trade} of {town} kept a {rng.choice(ANIMALS)} named {b}."
    if kind == 3:
        return f"{rng.choice(WEATHER).capitalize()}, and {a} stayed at {_place(rng)} of {town}."
    if kind == 4:
        return f"\"We need {rng.choice(NUMBER_WORDS)} more {good},\" said {a} to {b}."
    if kind == 5:
        return f"In the year {rng.randint(1200, 1899)}, {town} had {count} {trade}s and one {adjective} bridge."
    if kind == 6:
        return f"{a} was {rng.choice(FEELINGS)}, because {b} had {participle} the {good} to {other}."
    if kind == 7:
        price = f"{rng.randint(1, 20)} shillings and {rng.randint(1, 11)} pence"
        return f"A cask of {good} cost {price} in {town}, but less in {other}."
    if kind == 8:
        return f"From {_place(rng)} one could see the {adjective} roofs of {town}."
    if kind == 9:
        return f"{a} asked {b} the way to {other}, and {b} pointed past {_place(rng)}."
    if kind == 10:
        return f"The {rng.choice(ANIMALS)} of the {trade} ran through the {adjective} streets of {town}."
    return f"{a} and {b} counted {count} {good}, then {count + rng.randint(1, 9)}, and laughed."


def paragraph(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(3, 8)))


def generate(target_bytes: int = TARGET_BYTES, seed: int = SEED) -> bytes:
    """Paragraphs separated by blank lines until `target_bytes`; the last one is cut at that size."""
    rng, parts, size = random.Random(seed), [], 0
    while size < target_bytes:
        part = paragraph(rng) + "\n\n"
        parts.append(part)
        size += len(part)
    text = "".join(parts)[:target_bytes].encode("ascii")
    forbidden = set(text) & set(b"=;?")
    if forbidden:
        raise AssertionError(f"the corpus must not contain the retrieval delimiters {sorted(map(chr, forbidden))}")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the corpus file")
    args = parser.parse_args()
    text = generate()
    digest = hashlib.sha256(text).hexdigest()
    path = CORPUS_DIR / BUILTIN_CORPUS
    if args.write:
        # mtime 0 and no file name in the header: the compressed file is a function of the text.
        with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                  compresslevel=9) as zipped:
            zipped.write(text)
        print(f"wrote {path} ({len(text):,} bytes of text, {path.stat().st_size:,} compressed), sha256 {digest}")
        return 0
    if digest != BUILTIN_CORPUS_SHA256:
        print(f"this script makes text with sha256 {digest}, but data.py pins {BUILTIN_CORPUS_SHA256}")
        return 1
    print(f"{path.name}: this script reproduces the pinned text (sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
