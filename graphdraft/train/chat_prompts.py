"""Training prompts for a chat model's EAGLE-3 head, built offline from what Python ships.

EAGLE-3 trains its head on the target's own responses to a prompt set. Here the prompts are
- code: every documented public function and method of the Python standard library's
  sources (`graphdraft.io.corpus`, held-out documents excluded), asked in two of `CODE_FORMS`
  (complete the function from its signature and docstring, write it from its summary,
  explain it, test it);
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

CODE_FORMS = (
    "Complete the following Python function:\n```python\n{stub}```",
    "Write a Python function `{name}` that does the following: {summary}",
    "Explain what this Python function does, step by step:\n```python\n{source}```",
    "Write a few pytest unit tests for this function:\n```python\n{stub}```",
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
)


@dataclass(frozen=True)
class Function:
    """A documented public function (or method) of the standard library."""

    name: str
    stub: str
    """`def name(args):` and its docstring, indented as in a source file."""
    source: str
    summary: str
    """The docstring's first sentence."""
    where: str


def _functions_of(name: str, text: str, max_source: int) -> list[Function]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    nodes = [n for top in tree.body
             for n in ([top] if not isinstance(top, ast.ClassDef) else top.body)]
    for node in nodes:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 24:
            continue
        ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        body = textwrap.indent(f'"""{doc}\n"""', "    ")
        stub = f"def {node.name}({ast.unparse(node.args)}){ret}:\n{body}\n"
        source = ast.get_source_segment(text, node) or stub
        if len(source) > max_source:
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ")
        summary = summary.split(". ")[0].rstrip(".") + "."
        out.append(Function(node.name, stub, source + "\n", summary, name))
    return out


def stdlib_functions(max_source: int = 2000, limit: int | None = None) -> list[Function]:
    """Documented public functions and methods of the stdlib's training documents, in
    document-name order; the scan stops once `limit` are found (None: all)."""
    funcs = []
    for name, data in documents(lambda n: n.endswith(".py") and not is_held_out(n)):
        funcs += _functions_of(name, data.decode("utf-8", errors="replace"), max_source)
        if limit is not None and len(funcs) >= limit:
            return funcs[:limit]
    return funcs


def code_prompts(limit: int | None = None, seed: int = 0, forms_per_function: int = 2
                 ) -> list[str]:
    """`forms_per_function` user messages per function (distinct forms drawn with `seed`),
    shuffled; `limit` first."""
    rng = random.Random(seed)
    out = []
    need = None if limit is None else -(-limit // forms_per_function)
    for f in stdlib_functions(limit=need):
        for form in rng.sample(CODE_FORMS, forms_per_function):
            out.append(form.format(stub=f.stub, name=f.name, summary=f.summary,
                                   source=f.source))
    rng.shuffle(out)
    return out[:limit] if limit is not None else out


def prose_prompts(limit: int | None = None, seed: int = 0) -> list[str]:
    """Every template x topic, shuffled with `seed`; `limit` first."""
    out = [t.format(topic=topic) for t in PROSE_TEMPLATES for topic in PROSE_TOPICS]
    random.Random(seed).shuffle(out)
    return out[:limit] if limit is not None else out


def training_prompts(code: int, prose: int, seed: int = 0) -> list[tuple[str, str]]:
    """(kind, text) of up to `code` code and `prose` prose prompts, interleaved at random."""
    items = ([("code", p) for p in code_prompts(code, seed)]
             + [("prose", p) for p in prose_prompts(prose, seed)])
    random.Random(seed + 1).shuffle(items)
    return items
