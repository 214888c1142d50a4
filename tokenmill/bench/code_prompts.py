"""Twenty HumanEval-style code tasks (written for tokenmill): a signature and a docstring to
complete. Speculative decoding is measured on them because code repeats identifiers and
structure, which is what drafts and n-gram lookup predict."""

CODE_PROMPTS = [
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and non-alphanumeric characters.",
    "Write a Python function `fizzbuzz(n: int) -> list[str]` returning the FizzBuzz strings for 1..n.",
    "Write a Python function `merge_sorted(a: list[int], b: list[int]) -> list[int]` that merges two sorted lists.",
    "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` methods and a fixed capacity.",
    "Write a Python function `flatten(nested: list) -> list` that flattens arbitrarily nested lists.",
    "Write a Python function `word_count(text: str) -> dict[str, int]` counting lowercase words.",
    "Write a Python function `binary_search(xs: list[int], target: int) -> int` returning the index or -1.",
    "Write a Python function `transpose(matrix: list[list[int]]) -> list[list[int]]`.",
    "Write a Python function `parse_csv_line(line: str) -> list[str]` that handles quoted fields with commas.",
    "Write a Python function `roman_to_int(s: str) -> int` converting a Roman numeral to an integer.",
    "Write a Python function `chunk(xs: list, size: int) -> list[list]` splitting a list into chunks of a size.",
    "Write a Python function `gcd(a: int, b: int) -> int` and `lcm(a: int, b: int) -> int` using gcd.",
    "Write a Python function `dedupe(xs: list) -> list` that removes duplicates while keeping the order.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods, raising IndexError when empty.",
    "Write a Python function `rotate(xs: list[int], k: int) -> list[int]` rotating a list right by k steps.",
    "Write a Python function `count_vowels(s: str) -> int` and tests for it using assert statements.",
    "Write a Python function `matrix_multiply(a, b)` for lists of lists, checking that the shapes match.",
    "Write a Python function `to_snake_case(name: str) -> str` converting CamelCase identifiers to snake_case.",
    "Write a Python function `primes_up_to(n: int) -> list[int]` using the sieve of Eratosthenes.",
    "Write a Python function `group_by(items: list[dict], key: str) -> dict[str, list[dict]]`.",
]

# Prose for the mixed set: a draft model tracks its target less closely here, so a fixed draft
# length that suits code wastes draft steps (what adaptive k is for).
PROSE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old why the sky is blue.",
    "Describe the causes of the French Revolution in a few paragraphs.",
    "Write a persuasive letter asking a city council to build more bike lanes.",
    "What are the pros and cons of working from home? Answer in prose, not a list.",
    "Write a poem about the first snow of winter in a small mountain village.",
    "Summarize the plot of a heist movie you invent, with three twists.",
    "Give advice to someone starting their first job as a nurse.",
    "Describe a meal at a street market in Bangkok from the point of view of a tourist.",
    "Write a dialogue between a cat and a robot vacuum cleaner.",
]
