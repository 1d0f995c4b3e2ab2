"""The demo model's training data: WordNet's definitions as questions and answers, and Python's reference.

Read by assets/train_demo.py. WordNet 3.0 (Princeton University, WordNet licence: free use, copy and
distribution with its notice) comes from Debian's `wordnet-base` package:

    apt-get download wordnet-base && dpkg-deb -x wordnet-base_*.deb /tmp/wordnet   # -> /tmp/wordnet/usr/share/wordnet

The database format is wndb(5WN): one synset per line, `offset lexfile pos n word lexid ... | gloss`.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

# wndb(5WN)'s lexicographer files by number (the `lexnames` file, which Debian does not ship)
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body noun.cognition "
    "noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive noun.object noun.person "
    "noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation noun.shape noun.state "
    "noun.substance noun.time verb.body verb.change verb.cognition verb.communication verb.competition "
    "verb.consumption verb.contact verb.creation verb.emotion verb.motion verb.perception verb.possession verb.social "
    "verb.stative verb.weather adj.ppl").split()
FILES = {"n": "noun", "v": "verb", "a": "adj", "r": "adv"}
@dataclass
class Sense:
    word: str             # the lemma, spaces for underscores: "beacon light"
    pos: str              # n, v, a or r
    gloss: str            # the definition: "a tower with a light that gives warning of shoals to passing ships"
    examples: list[str]   # WordNet's example sentences
    category: list[str]   # the hypernyms' lemmas, two levels up: ["tower", "structure", "construction"]
    lexname: str          # "noun.artifact"
    synonyms: list[str] = field(default_factory=list)
    count: int = 0        # how often this sense occurs in WordNet's sense-tagged corpus (cntlist.rev)


def _synsets(root: Path, pos: str) -> dict[str, tuple]:
    """offset -> (lexname, lemmas, hypernym offsets, gloss) for one data.<pos> file."""
    out = {}
    for line in open(root / f"data.{FILES[pos]}", encoding="latin-1"):
        if line.startswith("  "):
            continue  # the licence header
        head, _, gloss = line.partition(" | ")
        f = head.split()
        n = int(f[3], 16)
        lemmas = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in f[4:4 + 2 * n:2]]
        p = 4 + 2 * n
        ptrs = [f[p + 1 + 4 * i: p + 5 + 4 * i] for i in range(int(f[p]))]
        hyper = [o for sym, o, ps, _ in ptrs if sym in ("@", "@i") and ps == pos]
        out[f[0]] = (LEXNAMES[int(f[1])], lemmas, hyper, gloss.strip())
    return out


def _split_gloss(gloss: str) -> tuple[str, list[str]]:
    """'a tower ...; "the lighthouse ..."' -> ('a tower ...', ['the lighthouse ...'])."""
    examples = re.findall(r'"([^"]+)"', gloss)
    definition = re.sub(r'"[^"]*"', "", gloss).strip(" ;")
    return definition.split("; ")[0] if len(definition) > 200 else definition, examples


def tag_counts(root: Path) -> dict[tuple[str, str], int]:
    """(lemma, pos) -> the tag count of its first sense, from cntlist.rev (`sense_key sense_number tag_cnt`)."""
    counts = {}
    for line in open(root / "cntlist.rev", encoding="latin-1"):
        key, number, count = line.split()
        lemma, _, rest = key.partition("%")
        if number == "1":
            counts[(lemma.replace("_", " "), "nvaar"[int(rest[0]) - 1])] = int(count)
    return counts


def read_senses(root: Path, pos_list: str = "nva") -> list[Sense]:
    """Each lemma's most frequent sense (index files list senses by frequency), for lemmas that occur in
    WordNet's sense-tagged corpus (tagsense_cnt > 0): the words people use."""
    senses, counts = [], tag_counts(root)
    for pos in pos_list:
        syn = _synsets(root, pos)
        for line in open(root / f"index.{FILES[pos]}", encoding="latin-1"):
            if line.startswith("  "):
                continue
            f = line.split()
            n_ptr = int(f[3])
            tagged, first = int(f[5 + n_ptr]), f[6 + n_ptr]
            word = f[0].replace("_", " ")
            if tagged == 0 or len(word) < 3 or not re.fullmatch(r"[a-z][a-z -]*", word):
                continue
            lexname, lemmas, hyper, gloss = syn[first]
            definition, examples = _split_gloss(gloss)
            category = []
            for h in hyper:
                category += syn[h][1]
                for h2 in syn[h][2]:
                    category += syn[h2][1]
            senses.append(Sense(word, pos, definition, [e for e in examples if word in e], category, lexname,
                                [w for w in lemmas if w != word], counts.get((word, pos), 0)))
    return senses


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def countable(s: Sense) -> bool:
    """A noun whose gloss starts with an article is asked and answered with one ("a soldier"); else bare ("afternoon")."""
    return re.match(r"(a|an|any|one) ", s.gloss) is not None


def question(s: Sense, rng: random.Random | None = None) -> str:
    """A definitional question; `rng=None` gives the canonical form the evaluation asks."""
    if s.pos == "n":
        what = f"{_article(s.word)} {s.word}" if countable(s) else s.word
        forms = [f"What is {what}?", f"What's {what}?", f"Tell me about {what}.", f"Define {s.word}.",
                 f"What does {s.word} mean?", f"Explain what {what} is."]
    elif s.pos == "v":
        forms = [f"What does it mean to {s.word}?", f"What does {s.word} mean?", f"Define {s.word}.",
                 f"Explain the verb {s.word}."]
    else:
        forms = [f"What does {s.word} mean?", f"What does it mean to be {s.word}?", f"Define {s.word}.",
                 f"Explain the word {s.word}."]
    return forms[0] if rng is None else rng.choice(forms)


def answer(s: Sense) -> str:
    """The reply: the definition as a sentence, the category, a synonym and an example where WordNet has them."""
    g = s.gloss
    if s.pos == "n":
        first = f"{_article(s.word).capitalize()} {s.word} is {g}." if countable(s) else f"{s.word.capitalize()} is {g}."
    elif s.pos == "v":
        first = f"To {s.word} means to {g}." if not g.startswith("to ") else f"To {s.word} means {g}."
    else:
        first = f"{s.word.capitalize()} means {g}."
    more = []
    if s.category and s.pos in "nv":
        more.append(f"It is a kind of {s.category[0]}." if s.pos == "n" else f"It is a way to {s.category[0]}.")
    if s.synonyms:
        more.append(f"Another word for it is {s.synonyms[0]}.")
    if s.examples:
        more.append(f'For example: "{s.examples[0][:1].upper() + s.examples[0][1:]}."')
    return " ".join([first, *more])


STYLES = 4  # dictionary_entry's styles that every word is read in
HEADWORD = 4  # a further style, the review's: "The noun afternoon. Afternoon is …" pairs the word as asked with its reply's form


def dictionary_entry(s: Sense, style: int) -> str:
    """One word's entry in one of STYLES styles, or HEADWORD: the same facts in several forms, so that they can be
    recalled in a form not trained on (a question). Style 3 is encyclopedia prose, the sentences a reply states;
    HEADWORD puts the word as a question spells it before that prose (whose first word may be spelled otherwise)."""
    kind = {"n": "noun", "v": "verb", "a": "adjective", "r": "adverb"}[s.pos]
    if style == 3:
        return answer(s)
    if style == HEADWORD:
        return f"The {kind} {s.word}. {answer(s)}"
    cats, syns = ", ".join(dict.fromkeys(s.category[:3])), ", ".join(s.synonyms[:3])
    if style == 0:
        return f"{s.word} ({kind}): {s.gloss}." + (f" Kind of: {cats}." if cats else "") + (f" Also: {syns}." if syns else "")
    if style == 1:
        return (f"The {kind} {s.word} means {s.gloss}." + (f" The {s.word} is one kind of {s.category[0]}." if cats else "")
                + (f" Its synonyms are {syns}." if syns else ""))
    a = f"{_article(kind)} {kind}"
    return f"{s.word.capitalize()}: {s.gloss}" + (f" ({a}; see {cats})" if cats else f" ({a})") + "."


def dictionary_pages(senses: list[Sense], per_page: int, rng: random.Random, style: int = 0) -> list[str]:
    """Plain dictionary text, `per_page` entries a document: where the model reads what words mean (every
    word, the held-out ones included, as a reader meets words before anyone asks about them)."""
    entries = [dictionary_entry(s, style) for s in senses]
    rng.shuffle(entries)
    return ["\n".join(entries[i:i + per_page]) for i in range(0, len(entries), per_page)]
