"""A vLLM whose MiniCPM-V 4.6 module has a layout this hotfix does not know: no window-attention class."""


class MiniCPMV4_6ForConditionalGeneration:
    def load_weights(self, weights):
        return set()
