"""The embedded default's long list settings, kept out of the schema (`specdistill/config.py`) for length."""

# Each self-written question starts from one of these, drawn uniformly; "" leaves the question free (plain
# Magpie). The starts steer the mix of tasks (instructions, math, code, translation) without a seed dataset.
DEFAULT_OPENERS = (
    "", "", "", "", "Write", "Write a short story", "Write an email", "Write a Python function", "Explain",
    "How do I", "How does", "What is", "What are the benefits of", "Why", "Who", "Where", "When", "Can you",
    "Give me", "List", "Describe", "Compare", "Solve", "Calculate", "If a", "A store", "Tom has", "Translate",
    "Translate this sentence into English:", "Translate German to English:", "Imagine you are", "Summarize",
    "Help me", "Correct the grammar",
)

# Tasks over a document the target wrote itself ("{document}" marks where it goes): summarising, rewriting,
# translating, extracting, answering from context, continuing. Each makes the head copy from its context.
DEFAULT_DOCUMENT_PROMPTS = (
    "Summarize the following text.\n\n{document}", "{document}\n\nWrite a short summary of the text above.",
    "Read the text below and explain its main point.\n\n{document}",
    "Rewrite this text in simpler words:\n\n{document}", "Translate the following text into French:\n\n{document}",
    "Translate the following text into German:\n\n{document}",
    "Extract the key facts from this text as a list.\n\n{document}",
    "Correct any mistakes in the following text and return the corrected version.\n\n{document}",
    "Context:\n{document}\n\nUsing only the context above, what is the most important detail?",
    "Continue this text with one more paragraph:\n\n{document}",
)
