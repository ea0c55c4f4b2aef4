"""Training prompts for a chat model's EAGLE-3 head, built offline from what Python ships.

EAGLE-3 trains its head on the target's own responses to a prompt set. Here the prompts are
- code: every documented public function, method and class of the Python standard
  library's sources (`graphdraft.io.corpus`, held-out documents excluded). A function is
  always asked as HumanEval asks (`HUMANEVAL_FORM` over the function laid out as a HumanEval
  problem, `humaneval_layout`) and in `forms_per_function - 1` more of `CODE_FORMS` (write
  it from its summary, explain, test, document, review, simplify it, show a call); a class
  in `forms_per_function` of `CLASS_FORMS`;
- typed problems with `>>>` examples in HumanEval's layout (`graphdraft.train.code_problems`,
  `problem_prompts`);
- prose: `PROSE_TEMPLATES` x `PROSE_TOPICS` (instructions over everyday, science, history
  and practical topics).
Both are disjoint from the evaluation sets of `perf/real.py` (HumanEval's problems; its own
prose questions, whose topics share nothing with `PROSE_TOPICS`: `tests/test_real_model.py`
checks it). Each prompt is one user message; the chat template is applied by the caller.
"""

from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass

from graphdraft.io.corpus import documents, is_held_out
from graphdraft.train.code_problems import problems

HUMANEVAL_FORM = "Complete the following Python function:\n```python\n{stub}```"
"""How `perf/real.py` asks HumanEval (its `HUMANEVAL_FORM`, the problem as `stub`)."""
CODE_FORMS = (
    HUMANEVAL_FORM,
    "Write a Python function `{name}` that does the following: {summary}",
    "Explain what this Python function does, step by step:\n```python\n{source}```",
    "Write a few pytest unit tests for this function:\n```python\n{stub}```",
    "Add type hints and a clear docstring to this Python function:\n```python\n{source}```",
    "Review this Python function: point out possible bugs and edge cases."
    "\n```python\n{source}```",
    "Rewrite this Python function to be shorter and easier to read:\n```python\n{source}```",
    "Show an example call of `{name}` and explain what it returns:\n```python\n{stub}```",
)
CLASS_FORMS = (
    "Implement the following Python class:\n```python\n{stub}```",
    "Write a Python class `{name}` for the following: {summary}",
    "Explain what this Python class is for and how to use it:\n```python\n{stub}```",
    "Write a short usage example for this class:\n```python\n{stub}```",
)
PROSE_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Write a short paragraph about {topic}.",
    "What are the most important things to know about {topic}?",
    "Give me three practical tips related to {topic}.",
    "Write a short story that involves {topic}.",
    "What are the pros and cons of {topic}?",
    "Describe the history of {topic} briefly.",
    "How would you teach a ten-year-old about {topic}?",
    "Write a haiku and then a short explanation about {topic}.",
    "List five facts about {topic}.",
    "Compare {topic} with something similar and explain the differences.",
    "Write an email to a friend recommending they learn about {topic}.",
    "What common misconceptions do people have about {topic}?",
    "Summarize why {topic} matters today.",
    "Write a dialogue between a teacher and a student about {topic}.",
    "Create a simple step-by-step plan for getting started with {topic}.",
    "Answer like an encyclopedia: what is {topic}?",
    "Write three quiz questions with answers about {topic}.",
    "Explain {topic} to an adult who knows nothing about it, in one paragraph.",
    "What questions should a beginner ask about {topic}?",
    "Write a short blog post introduction about {topic}.",
    "Give an analogy that makes {topic} easier to understand.",
    "What are common mistakes beginners make with {topic}?",
    "Write a motivational message for someone interested in {topic}.",
    "Summarize {topic} in exactly three sentences.",
    "Write a short news-style report about a recent discovery related to {topic}.",
    "How has {topic} changed over the last hundred years?",
    "Write a tweet-length fun fact about {topic}.",
    "Describe a day in the life of someone whose job involves {topic}.",
    "What vocabulary words should I learn to talk about {topic}? Define each.",
    "Argue for and against spending more public money on {topic}.",
    "Write a short FAQ section about {topic}.",
)
PROSE_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the moon landing",
    "the printing press", "the Roman Empire", "ancient Egypt", "the French Revolution",
    "the industrial revolution", "electricity", "magnetism", "gravity", "the human heart",
    "vaccines", "bacteria", "healthy sleep", "meditation", "running a marathon",
    "learning a new language", "playing the guitar", "baking bread", "making coffee",
    "growing tomatoes", "composting", "recycling plastic", "solar panels", "wind turbines",
    "electric cars", "bicycles", "public transport", "city planning", "saving money",
    "budgeting", "investing in index funds", "starting a small business", "job interviews",
    "writing a resume", "time management", "remote work", "team meetings", "public speaking",
    "reading more books", "keeping a journal", "photography", "painting with watercolors",
    "chess", "soccer", "basketball", "swimming", "hiking safely", "camping", "bird watching",
    "honey bees", "dolphins", "elephants", "penguins", "rainforests", "deserts", "glaciers",
    "earthquakes", "hurricanes", "weather forecasts", "climate change", "ocean tides",
    "the solar system", "Mars exploration", "telescopes", "satellites", "the internet",
    "email etiquette", "password security", "online privacy", "smartphones", "video games",
    "social media", "3D printing", "robots", "artificial intelligence", "machine learning",
    "databases", "spreadsheets", "version control", "open source software", "cloud computing",
    "the stock market", "inflation", "supply and demand", "taxes", "insurance",
    "first aid", "nutrition", "drinking enough water", "vegetarian cooking", "fermentation",
    "cheese making", "tea ceremonies", "jazz music", "classical music", "opera", "theater",
    "film editing", "comic books", "poetry", "mythology", "the Olympic Games", "architecture",
    "bridges", "skyscrapers", "castles", "lighthouses", "trains", "airplanes", "sailing",
    "maps and navigation", "time zones", "calendars", "clocks", "money and coins",
    "libraries", "museums", "volunteering", "friendship", "kindness", "dealing with stress",
    "moving to a new city", "adopting a pet", "training a dog", "caring for houseplants",
    "knitting", "woodworking", "pottery", "origami", "magic tricks", "board games",
    "puzzles", "riddles", "birthday parties", "weddings", "holidays around the world",
    "coral reefs", "rivers and deltas", "mountain formation", "fossils", "dinosaurs",
    "the periodic table", "chemical reactions", "atoms", "light and lenses", "sound waves",
    "the speed of light", "nuclear energy", "batteries", "semiconductors", "lasers",
    "the immune system", "the human brain", "bones and muscles", "digestion", "genetics",
    "evolution", "ecosystems", "endangered species", "wolves", "owls", "octopuses", "ant colonies",
    "butterflies", "sharks", "whales", "horses", "the Silk Road", "the Renaissance",
    "the Vikings", "ancient Greece", "the Ming dynasty", "the Aztecs", "the Cold War",
    "the printing of newspapers", "the telephone", "radio broadcasting", "television",
    "photovoltaic farms", "hydroelectric dams", "irrigation", "organic farming", "beekeeping",
    "wine making", "chocolate", "spices", "sushi", "pasta", "street food", "table manners",
    "minimalism", "decluttering", "interior design", "gardening in small spaces",
    "home repairs", "plumbing basics", "electric wiring safety", "car maintenance",
    "learning to drive", "road safety", "air travel", "packing a suitcase", "travel insurance",
    "learning mathematics", "algebra", "geometry", "probability", "statistics",
    "prime numbers", "fractions", "the history of zero", "cryptography", "computer networks",
    "operating systems", "programming languages", "web browsers", "search engines",
    "data backups", "spam filters", "computer viruses", "quantum computing",
    "virtual reality", "self-driving vehicles", "drones", "space stations", "rockets",
    "comets", "the sun", "stars and constellations", "galaxies", "the Big Bang",
    "economics", "banking", "credit cards", "loans and interest", "retirement savings",
    "entrepreneurship", "marketing", "negotiation", "leadership", "customer service",
    "teamwork", "conflict resolution", "parenting", "grandparents", "sibling rivalry",
    "teenagers and school", "homework", "exams", "studying effectively", "note taking",
    "critical thinking", "philosophy", "ethics", "democracy", "human rights",
    "elections", "the United Nations", "international trade", "languages of the world",
    "sign language", "writing systems", "dictionaries", "translation", "storytelling",
    "fairy tales", "science fiction", "mystery novels", "biographies", "drawing portraits",
    "sculpture", "dance", "ballet", "hip hop", "drums", "the violin", "choirs",
    "music festivals", "film history", "animation", "stand-up comedy", "circuses",
    "zoos", "aquariums", "national parks", "mountaineering", "skiing", "surfing",
    "yoga", "strength training", "cycling races", "tennis", "golf", "table tennis",
    "martial arts", "sportsmanship", "healthy breakfast", "sugar", "allergies",
    "the common cold", "dental hygiene", "eyesight", "hearing", "aging", "mindfulness",
    "habits", "motivation", "procrastination", "creativity", "curiosity", "gratitude",
)


@dataclass(frozen=True)
class Function:
    """A documented public function, method or class of the standard library."""

    name: str
    stub: str
    """`def name(args):` (or `class name(bases):`) and its docstring, indented as in a source
    file."""
    source: str
    summary: str
    """The docstring's first sentence."""
    where: str
    is_class: bool = False
    humaneval_stub: str = ""
    """The definition laid out as a HumanEval problem (`humaneval_layout`; functions only)."""


TYPING_NAMES = frozenset({"Any", "Callable", "Dict", "FrozenSet", "Iterable", "Iterator",
                          "List", "Mapping", "Optional", "Sequence", "Set", "Tuple", "Type",
                          "Union"})


def humaneval_layout(node: ast.FunctionDef, doc: str) -> str:
    """A function (a method without its `self` / `cls`) as HumanEval lays a problem out: a
    `from typing import ...` header when its annotations use those names, two blank lines,
    the signature, the docstring indented by four (opened on its own line or on the quotes'
    line, by the name's length) and nothing after it."""
    a = node.args
    posonly, plain = list(a.posonlyargs), list(a.args)
    first = (posonly or plain)[:1]
    if first and first[0].arg in ("self", "cls"):
        (posonly if posonly else plain).pop(0)
        n_defaults = len(a.defaults)
        a = ast.arguments(posonlyargs=posonly, args=plain, vararg=a.vararg,
                          kwonlyargs=a.kwonlyargs, kw_defaults=a.kw_defaults, kwarg=a.kwarg,
                          defaults=a.defaults[max(0, n_defaults - len(posonly) - len(plain)):])
    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    names = {n.id for part in (a, node.returns) if part is not None
             for n in ast.walk(part) if isinstance(n, ast.Name)}
    used = sorted(names & TYPING_NAMES)
    header = f"from typing import {', '.join(used)}\n\n\n" if used else "\n\n"
    lines = doc.strip().splitlines()
    body = "\n".join(f"    {ln}" if ln.strip() else "" for ln in lines)
    opened = f'    """ {body.lstrip()}' if len(node.name) % 2 else f'    """\n{body}'
    return f"{header}def {node.name}({ast.unparse(a)}){ret}:\n{opened}\n    \"\"\"\n"


def _definitions(tree: ast.Module) -> list[ast.FunctionDef | ast.ClassDef]:
    """Top-level functions and classes, and the methods of top-level classes."""
    out = []
    for top in tree.body:
        if isinstance(top, ast.ClassDef | ast.FunctionDef):
            out.append(top)
        if isinstance(top, ast.ClassDef):
            out += [n for n in top.body if isinstance(n, ast.FunctionDef)]
    return out


def _functions_of(name: str, text: str, max_source: int) -> list[Function]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in _definitions(tree):
        doc = ast.get_docstring(node)
        if node.name.startswith("_") or not doc or len(doc) < 24:
            continue
        body = textwrap.indent(f'"""{doc}\n"""', "    ")
        if isinstance(node, ast.ClassDef):
            bases = ", ".join(ast.unparse(b) for b in node.bases)
            stub = f"class {node.name}{f'({bases})' if bases else ''}:\n{body}\n"
        else:
            ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            stub = f"def {node.name}({ast.unparse(node.args)}){ret}:\n{body}\n"
        source = textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno]))
        if len(source) > max_source:
            if not isinstance(node, ast.ClassDef):
                continue
            source = stub  # a class is asked about from its stub
        summary = doc.strip().split("\n\n")[0].replace("\n", " ")
        summary = summary.split(". ")[0].rstrip(".") + "."
        is_class = isinstance(node, ast.ClassDef)
        out.append(Function(node.name, stub, source.rstrip("\n") + "\n", summary, name,
                            is_class, "" if is_class else humaneval_layout(node, doc)))
    return out


def stdlib_functions(max_source: int = 2000, limit: int | None = None) -> list[Function]:
    """Documented public functions, methods and classes of the stdlib's training documents,
    in document-name order; the scan stops once `limit` are found (None: all)."""
    funcs = []
    for name, data in documents(lambda n: n.endswith(".py") and not is_held_out(n)):
        funcs += _functions_of(name, data.decode("utf-8", errors="replace"), max_source)
        if limit is not None and len(funcs) >= limit:
            return funcs[:limit]
    return funcs


def code_prompts(limit: int | None = None, seed: int = 0, forms_per_function: int = 4
                 ) -> list[str]:
    """`forms_per_function` user messages per definition, shuffled; `limit` first. A function
    is always asked in HumanEval's form (`HUMANEVAL_FORM` over its `humaneval_stub`), plus
    `forms_per_function - 1` distinct other forms of `CODE_FORMS` drawn with `seed`; a class
    in `forms_per_function` forms of `CLASS_FORMS`."""
    if forms_per_function < 1:
        raise ValueError(f"forms_per_function: expected at least 1, got {forms_per_function}")
    rng = random.Random(seed)
    out = []
    need = None if limit is None else -(-limit // forms_per_function)
    for f in stdlib_functions(limit=need):
        if f.is_class:
            forms = rng.sample(CLASS_FORMS, min(forms_per_function, len(CLASS_FORMS)))
        else:
            out.append(HUMANEVAL_FORM.format(stub=f.humaneval_stub))
            others = CODE_FORMS[1:]
            forms = rng.sample(others, min(forms_per_function - 1, len(others)))
        out += [form.format(stub=f.stub, name=f.name, summary=f.summary, source=f.source)
                for form in forms]
    rng.shuffle(out)
    return out[:limit] if limit is not None else out


def problem_prompts(limit: int, seed: int = 0) -> list[str]:
    """`limit` typed problems with examples (`graphdraft.train.code_problems`) in HumanEval's
    form."""
    if limit < 0:
        raise ValueError(f"typed_problems: expected a count >= 0, got {limit}")
    return [HUMANEVAL_FORM.format(stub=p) for p in problems(limit, seed)]


def prose_prompts(limit: int | None = None, seed: int = 0) -> list[str]:
    """Every template x topic, shuffled with `seed`; `limit` first."""
    out = [t.format(topic=topic) for t in PROSE_TEMPLATES for topic in PROSE_TOPICS]
    random.Random(seed).shuffle(out)
    return out[:limit] if limit is not None else out


def training_prompts(code: int, prose: int, seed: int = 0, typed_problems: int = 0,
                     forms_per_function: int = 4) -> list[tuple[str, str]]:
    """(kind, text) of up to `code` stdlib code prompts (`forms_per_function` each),
    `typed_problems` typed problems (kind "code") and `prose` prose prompts, interleaved at
    random."""
    items = ([("code", p) for p in code_prompts(code, seed, forms_per_function)]
             + [("code", p) for p in problem_prompts(typed_problems, seed)]
             + [("prose", p) for p in prose_prompts(prose, seed)])
    random.Random(seed + 1).shuffle(items)
    return items
