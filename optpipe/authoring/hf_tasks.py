"""The task of a Hugging Face folder, for `optpipe init`: which transformers Auto class builds its architecture,
and which verdict task (evaluate.task.kind) reads that head's output."""
from __future__ import annotations


# Architecture name endings -> Optimum task names (as optimum.exporters.tasks infers them).
ARCHITECTURE_TASKS = (
    ("ForSequenceClassification", "sequence-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForMaskedLM", "fill-mask"),
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForImageClassification", "image-classification"),
    ("ForObjectDetection", "object-detection"),
    ("ForSemanticSegmentation", "semantic-segmentation"),
    ("ForAudioClassification", "audio-classification"),
    ("ForConditionalGeneration", "seq2seq-lm"),  # only for an encoder-decoder (architecture_task): not Llava's
    ("ForMultipleChoice", "multiple-choice"),
    ("ForPreTraining", "pretraining"),
    ("ForNextSentencePrediction", "next-sentence-prediction"),
    ("ForCTC", "ctc"),
    ("ForAudioFrameClassification", "audio-frame-classification"),
    ("ForXVector", "audio-xvector"),
    ("ForDepthEstimation", "depth-estimation"),
    ("ForVideoClassification", "video-classification"),
)


# Tasks -> transformers' own tables of the class each model type's Auto class builds for it. Not pretraining's: its
# table also holds LM heads and vision-language models, which the name's own task (or AutoModel) builds as before.
TASK_MAPPINGS = {task: f"MODEL_FOR_{name}_MAPPING_NAMES" for task, name in (
    ("sequence-classification", "SEQUENCE_CLASSIFICATION"), ("audio-classification", "AUDIO_CLASSIFICATION"),
    ("token-classification", "TOKEN_CLASSIFICATION"), ("question-answering", "QUESTION_ANSWERING"),
    ("fill-mask", "MASKED_LM"), ("causal-lm", "CAUSAL_LM"), ("image-classification", "IMAGE_CLASSIFICATION"),
    ("object-detection", "OBJECT_DETECTION"), ("semantic-segmentation", "SEMANTIC_SEGMENTATION"),
    ("seq2seq-lm", "SEQ_TO_SEQ_CAUSAL_LM"), ("speech-seq2seq", "SPEECH_SEQ_2_SEQ"), ("multiple-choice", "MULTIPLE_CHOICE"),
    ("next-sentence-prediction", "NEXT_SENTENCE_PREDICTION"), ("ctc", "CTC"),
    ("audio-frame-classification", "AUDIO_FRAME_CLASSIFICATION"), ("audio-xvector", "AUDIO_XVECTOR"),
    ("depth-estimation", "DEPTH_ESTIMATION"), ("video-classification", "VIDEO_CLASSIFICATION"))}


def architecture_task(config: dict) -> str:
    """The task whose Auto class builds the folder's architecture. Its name's ending is not enough: an audio
    classifier is `Wav2Vec2ForSequenceClassification`, which AutoModelForSequenceClassification refuses
    ("Unrecognized configuration class"); transformers' tables say which Auto class builds it. The ending
    decides where the tables do not know the model type (remote code)."""
    from transformers.models.auto import modeling_auto

    architecture = (config.get("architectures") or [""])[0]
    by_name = next((t for suffix, t in ARCHITECTURE_TASKS if architecture.endswith(suffix)), "feature-extraction")
    if by_name == "seq2seq-lm" and not config.get("is_encoder_decoder"):
        by_name = "feature-extraction"  # a vision-language ...ForConditionalGeneration is no encoder-decoder
    for task in sorted(TASK_MAPPINGS, key=lambda t: t != by_name):  # the name's own task first
        built = getattr(modeling_auto, TASK_MAPPINGS[task], {}).get(config.get("model_type"))
        if architecture and architecture in ((built,) if isinstance(built, str) else built or ()):
            return task
    return by_name


# Optimum tasks whose head's output a task metric reads (evaluate.task.kind): the verdict then
# checks the predictions (top-1, next token), which cosine alone lets flip.
HF_VERDICT_TASKS = {"sequence-classification": "classification", "token-classification": "classification",
                    "question-answering": "classification",
                    "image-classification": "classification",
                    "audio-classification": "classification", "causal-lm": "language-model", "seq2seq-lm": "language-model",
                    "speech-seq2seq": "language-model",
                    "semantic-segmentation": "segmentation", "multiple-choice": "classification",
                    "next-sentence-prediction": "classification", "video-classification": "classification"}


def verdict_task(task: str, config: dict) -> tuple[str | None, list[str]]:
    """The task metric for a Hugging Face head (HF_VERDICT_TASKS), and init's notes. A classification head with one
    label is a regression (transformers' problem_type for num_labels 1): its top-1 agreement over one class is 1 by
    construction, so no classification task; the compile holds its one value per sample by R² (docs/accuracy.md)."""
    kind = HF_VERDICT_TASKS.get(task)
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or None
    if kind == "classification" and task != "multiple-choice" and (labels == 1 or config.get("problem_type") == "regression"):
        return None, [f"a {task} head with one label (a regression): no classification task, whose top-1 agreement over "
                      "one class would read 1.000 whatever a stage does; its one value per sample is held by R²"]
    return kind, []


def task_keys(kind: str, hf_task: str | None, input_names: list[str]) -> str:
    """A verdict task's keys beyond its kind, as init writes them: a question-answering head's answer is its start and
    its end position together (both logits, one agreement); an encoder-decoder's logits are over its decoder_input_ids,
    the tokens the language-model task then reads."""
    from optpipe.core.runtime import DECODER_IDS

    if kind == "classification" and hf_task == "question-answering":
        return ", output: [start_logits, end_logits]"
    return f", tokens: {DECODER_IDS}" if kind == "language-model" and DECODER_IDS in input_names else ""
