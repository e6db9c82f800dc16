"""Prompt templates for math problems.

`render_prompt` is the one template used for evaluation, for RL training and for the bundled tiny
model's pretraining corpus, so its exact text is part of the project's contract (see
docs/tiny_world.md): changing a single character changes what the tiny model has learned to
continue.
"""


def render_prompt(problem):
    """Wrap a math problem in the standard prompt; the model's completion follows "Answer:"."""
    return (
        "You are a helpful math assistant.\n"
        "Answer the question and write the final result on a new line as:\n"
        "\\boxed{ANSWER}\n\n"
        f"Question:\n{problem}\n\nAnswer:"
    )


def render_prompt_with_think_tokens(problem):
    """Like `render_prompt`, but asks for the reasoning inside <think> ... </think> first."""
    return (
        "You are a helpful math assistant.\n"
        "When solving the problem, first write your reasoning inside <think> and </think> tags.\n"
        "Then write the final result on a new line in the exact format:\n"
        "\\boxed{ANSWER}\n\n"
        f"Question:\n{problem}\n\nAnswer:"
    )
