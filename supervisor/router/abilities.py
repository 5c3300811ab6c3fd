"""What an external engine (vLLM, SGLang, `transformers serve`, any OpenAI-compatible server) takes, as the
supervisor learned it when the engine went READY (supervisor/effects/abilities.py). The router continues a
stream lost with its engine by the best path the new primary takes (supervisor/router/continuation.py):

- ``token_ids``: the engine takes a completion prompt of token ids and returns the ids it generates
  (vLLM's ``return_token_ids``): the exact continuation, prompt ids + the ids already sent;
- else a replay by text: completions get the prompt plus the text already sent; chat completions (where
  ``chat_continue``: the engine continues a final assistant message, ``continue_final_message``) get the
  assistant's partial message to continue; a valid continuation, not necessarily the same text;
- neither: the stream ends with an explicit error event.

An Upstream without abilities is our own engine (its ``continuation`` field, token ids, batches)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Abilities(BaseModel):
    """One external engine's model id and continuation paths."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_id: str  # what requests name the model (its /v1/models id, else model.name or the folder's name)
    token_ids: bool = False  # takes `prompt: [ids]`, returns `token_ids` (return_token_ids)
    chat_continue: bool = False  # continues a final assistant message (continue_final_message)

    def brief(self) -> str:
        """One line for the log and status."""
        paths = ["completions: exact (token ids)" if self.token_ids else "completions: replay by text",
                 "chat: replay by text" if self.chat_continue else "chat: not continued"]
        return f"model id {self.model_id!r}; continuation: {', '.join(paths)}"
