"""DataError: the one error every input check raises, in a module of its own so the modules that read prompts
(prompts, chat_format, images, tokenizer, prompt_mix, prompt_loader) import it without importing each other."""


class DataError(ValueError):
    """The prompt data or tokenizer cannot be used; the message names the file/flag and the fix."""
